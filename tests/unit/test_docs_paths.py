"""The docs name only what the tree holds: every repository path (`fivar/...`, `docs/...`, `benchmarks/...`,
`tests/...`, `templates/...`, `csrc/...`, `variants/...`), every relative link and its #anchor, and every dotted
`fivar.x.y` name in README.md, docs/*.md and the benchmarks' READMEs exists, so a page cannot keep naming a file
after it moves or goes."""
import glob
import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Top-level directories whose paths the pages name, relative to the repository root.
TREE_ROOTS = ("fivar", "docs", "benchmarks", "tests", "templates", "csrc", "variants")

#: Paths a page names that are, rightly, not in the tree, and why.
NOT_IN_TREE = {
    "variants/softcap_alibi.py": "written by `fivar new-variant softcap_alibi` in the README's walk-through",
    "tests/variants/test_softcap_alibi.py": "written by `fivar new-variant softcap_alibi` in the README's walk-through",
    "csrc/single_prefill.cu": "FlashInfer's own source (docs/flashinfer-compat.md)",
}

#: File names a page gives without a directory that are not in the tree: FlashInfer's headers, files fivar writes.
NAMES_NOT_IN_TREE = {
    "prefill.cuh": "FlashInfer's include/flashinfer/attention/prefill.cuh",
    "utils.cuh": "FlashInfer's include/flashinfer/utils.cuh",
    "permuted_smem.cuh": "FlashInfer's include/flashinfer/permuted_smem.cuh",
    "fivar_export.json": "the index `fivar cache export` writes into an archive",
}

_PATH = re.compile(r"(?<![\w./~<>$-])(?:%s)/[\w./*{},<>-]*" % "|".join(TREE_ROOTS))
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_BARE = re.compile(r"(?<![\w./<>*{},-])([\w-]+\.(?:py|cuh|cu|jinja|md|jsonl|toml|json))\b")
_DOTTED = re.compile(r"(?<![\w./-])fivar(?:\.[A-Za-z_]\w*)+")


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md")),
            *sorted(p for p in (root / "benchmarks").rglob("README.md"))]


def _expand(path: str) -> list[str]:
    """`a/{b,c}.py` -> a/b.py, a/c.py (nested braces too)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return list(itertools.chain.from_iterable(_expand(path[:m.start()] + alt + path[m.end():])
                                              for alt in m.group(1).split(",")))


def _exists(root: Path, path: str) -> bool:
    """A path, a glob (`*.cu.jinja`) or a placeholder (`<gpu>.jsonl`: any name) that matches something."""
    pattern = re.sub(r"<[^<>]*>", "*", path)
    return bool(glob.glob(str(root / pattern))) if "*" in pattern else (root / pattern).exists()


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _module_file(root: Path, parts: list[str]) -> Path | None:
    base = root.joinpath(*parts)
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


def missing(page: Path, root: Path = ROOT, allowed: dict = NOT_IN_TREE,
            allowed_names: dict = NAMES_NOT_IN_TREE) -> list[str]:
    """`page:line: what` for every path, link, anchor, file name or dotted fivar name on `page` the tree lacks.
    A file name without a directory (`ceilings.py`) has to be some file's name in the tree."""
    names = {p.name for p in root.rglob("*") if ".git" not in p.parts}
    out = []
    for i, line in enumerate(page.read_text().splitlines(), 1):
        where = f"{page.relative_to(root)}:{i}"
        for m in _PATH.finditer(line):
            raw = m.group(0).rstrip(".,;:")
            for path in _expand(raw):
                if path not in allowed and not _exists(root, path):
                    out.append(f"{where}: path {raw}")
        for m in _BARE.finditer(_LINK.sub("]()", line)):  # link targets are checked as links below
            if m.group(1) not in names and m.group(1) not in allowed_names:
                out.append(f"{where}: file {m.group(1)}")
        for m in _LINK.finditer(line):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path) if path else page
            if not linked.exists():
                out.append(f"{where}: link {target}")
            elif anchor and linked.suffix == ".md":
                heads = {_slug(h.lstrip("#")) for h in linked.read_text().splitlines() if h.startswith("#")}
                if anchor not in heads:
                    out.append(f"{where}: anchor {target}")
        for m in _DOTTED.finditer(line):
            # the longest prefix that is a module; the next name must be defined or imported in it
            parts = m.group(0).split(".")
            k = len(parts)
            while k > 1 and _module_file(root, parts[:k]) is None:
                k -= 1
            module = _module_file(root, parts[:k])
            if module is None:
                out.append(f"{where}: module {m.group(0)}")
            elif k < len(parts) and not re.search(rf"\b{re.escape(parts[k])}\b", module.read_text()):
                out.append(f"{where}: name {m.group(0)}")
    return out


def test_every_page_names_only_what_exists():
    assert len(pages()) >= 10
    found = [f for page in pages() for f in missing(page)]
    assert not found, "the docs name what the tree lacks:\n" + "\n".join(found)


def test_what_is_not_in_the_tree_is_still_named_and_still_absent():
    text = "\n".join(p.read_text() for p in pages())
    for path, why in NOT_IN_TREE.items():
        assert path in text, f"{path} is no longer named by any page: drop it from NOT_IN_TREE"
        assert not (ROOT / path).exists(), f"{path} exists now: drop it from NOT_IN_TREE ({why})"
    in_tree = {p.name for p in ROOT.rglob("*") if ".git" not in p.parts}
    for name, why in NAMES_NOT_IN_TREE.items():
        assert name in text, f"{name} is no longer named by any page: drop it from NAMES_NOT_IN_TREE"
        assert name not in in_tree, f"{name} is in the tree now: drop it from NAMES_NOT_IN_TREE ({why})"


def test_the_check_finds_what_is_missing(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "fivar" / "jit").mkdir(parents=True)
    (tmp_path / "fivar" / "__init__.py").write_text("")
    (tmp_path / "fivar" / "jit" / "__init__.py").write_text("")
    (tmp_path / "fivar" / "jit" / "store.py").write_text("def scan():\n    pass\n")
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## The cache\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text("\n".join([
        "`fivar/jit/store.py` and fivar/jit/{store,archive}.py and `fivar/jit/*.py`, fivar/jit/<x>.py.",
        "[ok](other.md#the-cache) [gone](gone.md) [bad anchor](other.md#no-such) [self](#page)",
        "fivar.jit.store.scan and fivar.jit.store.prune, fivar.nothing.here",
        "fivar/jit/gone.py, see `fivar/spec/`; store.py and `gone.py`.",
        "# Page"]))
    got = missing(page, tmp_path, allowed={})
    assert got == ["docs/page.md:1: path fivar/jit/{store,archive}.py",
                   "docs/page.md:2: link gone.md",
                   "docs/page.md:2: anchor other.md#no-such",
                   "docs/page.md:3: name fivar.jit.store.prune",
                   "docs/page.md:3: name fivar.nothing.here",
                   "docs/page.md:4: path fivar/jit/gone.py",
                   "docs/page.md:4: path fivar/spec/",
                   "docs/page.md:4: file gone.py"], got
    allowed = missing(page, tmp_path, allowed={"fivar/jit/gone.py": "", "fivar/spec/": ""},
                      allowed_names={"gone.py": ""})
    assert allowed == got[:-3], allowed


def test_every_tool_has_its_line_in_the_tools_readme():
    """benchmarks/tools/README.md names each script there, and only those (a deleted tool leaves no row)."""
    tools = ROOT / "benchmarks" / "tools"
    rows = set(re.findall(r"^\| `([\w-]+\.py)` \|", (tools / "README.md").read_text(), re.M))
    assert rows == {p.name for p in tools.glob("*.py")}
