"""`fivar cache`: look at, verify, prune, clear, export and import fivar's modules in FlashInfer's JIT cache.

Each command parses its options, asks fivar.jit.store (fivar.jit.archive for export/import, fivar.trust for
keys) and prints the result, or with --json the same data as JSON.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import click
from rich.table import Column, Table

from ..errors import FivarError
from ..jit import archive, store
from ..jit.store import UNKNOWN_TOOLCHAIN, disk_errors, human_age, human_size
from ._common import console, main

#: where the store's warnings go (malformed records, libraries imported from an untrusted archive)
_warn = functools.partial(click.echo, err=True)


def _out(as_json: bool, data, render) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=1, default=str))
    else:
        render()


def arch_option(f):
    """`--arch` on every subcommand too (`fivar cache ls --arch 9.0a`), the same as the group's."""
    def set_arch(ctx, param, value):
        if value is not None:
            from ..jit.toolchain import set_arch_env
            set_arch_env(value)
    return click.option("--arch", default=None, expose_value=False, is_eager=True, callback=set_arch,
                        help="target arch of the current toolchain, e.g. 9.0a (as `fivar cache --arch`)")(f)


@click.group()
@click.option("--arch", default=None, help="target arch of the current toolchain, e.g. 9.0a (default: "
              "FLASHINFER_CUDA_ARCH_LIST or the visible GPU)")
def cache(arch):
    """fivar's modules in FlashInfer's JIT cache: ls, show, stats, verify, prune, clear, export, import; keygen
    and trust for signed archives."""
    from ..jit.toolchain import set_arch_env
    set_arch_env(arch)


main.add_command(cache)


@cache.command("ls")
@arch_option
@click.option("--json", "as_json", is_flag=True)
@click.option("--no-stale-check", is_flag=True, help="skip re-rendering each variant (faster)")
def ls_cmd(as_json, no_stale_check):
    """Every fivar module: size, compile seconds, hits, last use, provenance, stale or not."""
    entries = store.annotate(store.scan_entries(), check_stale=not no_stale_check, warn=_warn)

    def render():
        t = Table(Column("module", overflow="fold"), "size", "compile s", "hits", "last use", "variant / op / dtype / hd", "status",
                  title=f"fivar cache: {len(entries)} module(s), "
                        f"{human_size(sum(e.size for e in entries))} in {store.flashinfer_cache_root()}")
        unknown = any(e.reasons == [UNKNOWN_TOOLCHAIN] for e in entries)
        for e in entries:
            status = ("[red]stale[/]: " + "; ".join(e.reasons)) if e.stale else \
                ("[green]ok[/]" if e.stale is False else
                 "?" if e.reasons == [UNKNOWN_TOOLCHAIN] else "? " + "; ".join(e.reasons))
            if e.holders:
                status += f" (in use: pid {', '.join(map(str, e.holders))})"
            t.add_row(e.uri, human_size(e.size), "-" if e.compile_seconds is None else f"{e.compile_seconds:.1f}",
                      str(e.hits), human_age(e.last_use), e.provenance, status)
        console.print(t)
        if unknown:
            console.print(f"?: {UNKNOWN_TOOLCHAIN}", highlight=False)
    _out(as_json, [e.to_json() for e in entries], render)


@cache.command()
@arch_option
@click.argument("uri")
@click.option("--json", "as_json", is_flag=True)
@click.option("--events", default=20, show_default=True, help="how many recent events to show")
def show(uri, as_json, events):
    """One module: manifest, files, staleness, live holders and its recent build/load events."""
    e, data = store.details(uri, events, warn=_warn)

    def render():
        console.print(f"[bold]{e.uri}[/]  {e.provenance}")
        for k in ("path", "generated", "size_bytes", "compile_seconds", "hits", "arch", "flashinfer", "nvcc"):
            console.print(f"  {k}: {data[k]}", highlight=False)
        console.print(f"  last use: {human_age(e.last_use)}   stale: {e.stale} {'; '.join(e.reasons)}",
                      highlight=False)
        console.print(f"  live holders: {e.holders or '-'}", highlight=False)
        t = Table("when", "action", "kind", "count", "seconds", "host", "pid", title="recent events")
        for ev in data["events"]:
            t.add_row(human_age(ev["time"]), ev["action"], ev["kind"], str(ev["count"]), f"{ev['seconds']:.3f}",
                      ev["host"], str(ev["pid"]))
        console.print(t)
    _out(as_json, data, render)


@cache.command()
@arch_option
@click.option("--window", default="7d", show_default=True, help="how far back, e.g. 12h, 7d, 4w")
@click.option("--json", "as_json", is_flag=True)
def stats(window, as_json):
    """Hit rate and compile-time distribution over a time window."""
    data = store.usage_stats(window)

    def render():
        hr = "-" if data["hit_rate"] is None else f"{100 * data['hit_rate']:.1f}%"
        console.print(f"[bold]last {window}[/]: {data['requests']} requests, {data['cold']} cold compiles, "
                      f"{data['disk_hits']} disk hits, {data['memory_hits']} memory hits; hit rate {hr}",
                      highlight=False)
        cs = data["compile_seconds"]
        if cs["count"]:
            console.print(f"compile seconds: n={cs['count']} total={cs['total']:.1f} mean={cs['mean']:.1f} "
                          f"min={cs['min']:.1f} p50={cs['p50']:.1f} p90={cs['p90']:.1f} max={cs['max']:.1f}",
                          highlight=False)
        t = Table("variant", "cold", "hits", "compile s")
        for r in data["per_variant"]:
            t.add_row(str(r["variant"]), str(r["cold"]), str(r["hits"]), f"{r['compile_seconds']:.1f}")
        console.print(t)
    _out(as_json, data, render)


@cache.command()
@arch_option
@click.option("--fix", is_flag=True, help="delete invalid libraries (and their manifests) so the next build "
              "rebuilds them")
@click.option("--json", "as_json", is_flag=True)
@click.argument("prefix", required=False, default="")
@disk_errors("verify the cache")
def verify(fix, as_json, prefix):
    """Check modules' libraries against their manifests (size, mtime, sha256) and generated sources.

    PREFIX limits the check to modules whose URI starts with it (default: every module).
    """
    results = store.verify(prefix, fix)

    def render():
        for r in results:
            status = ("[yellow]being built[/]" if r.get("building") else "[green]ok[/]" if r["ok"]
                      else "[red]" + "; ".join(r["problems"]) + "[/]")
            console.print(f"{r['uri']}: {status}{' (removed: rebuilds on next use)' if r['fixed'] else ''}",
                          highlight=False)
        console.print(f"{sum(r['ok'] for r in results)}/{len(results)} ok")
    _out(as_json, results, render)
    if any(not r["ok"] and not r["fixed"] for r in results):
        raise SystemExit(1)


@cache.command()
@arch_option
@click.option("--max-size", default=None, help="evict least-recently-used modules until the total is under "
              "this, e.g. 20G")
@click.option("--older-than", default=None, help="evict modules not used for this long, e.g. 30d")
@click.option("--stale", "stale_only", is_flag=True, help="evict stale modules (other toolchain, edited "
              "variant, interrupted build)")
@click.option("--dry-run", is_flag=True, help="list what would be evicted, evict nothing")
@click.option("--json", "as_json", is_flag=True)
@disk_errors("prune the cache")
def prune(max_size, older_than, stale_only, dry_run, as_json):
    """Evict least-recently-used modules; never one a live process has loaded or one being built."""
    data = store.prune(max_size, older_than, stale_only, dry_run, warn=_warn)

    def render():
        verb = "would evict" if dry_run else "evicted"
        for r in data["evicted"]:
            console.print(f"{verb} {r['uri']} ({human_size(r['size_bytes'])}; {r['reason']})", highlight=False)
        for r in data["skipped"]:
            console.print(f"[yellow]kept[/] {r['uri']}: {r['skipped']}", highlight=False)
        console.print(f"{verb} {len(data['evicted'])} module(s), {human_size(data['freed_bytes'])}")
    _out(as_json, data, render)


@cache.command()
@arch_option
@click.option("--records", "wipe_records", is_flag=True, help="also delete the build/load records")
@click.option("--yes", is_flag=True, help="do not ask")
@click.option("--json", "as_json", is_flag=True)
@disk_errors("clear the cache")
def clear(wipe_records, yes, as_json):
    """Delete every fivar module (not FlashInfer's own), except ones in use or being built."""
    entries = store.annotate(store.scan_entries(), check_stale=False, warn=_warn)
    if not yes and not as_json and entries:
        in_use = sum(bool(store.in_use(e)) or store.lock_is_held(e.lock_path) for e in entries)
        click.confirm(f"delete {len(entries) - in_use} fivar module(s) from {store.flashinfer_cache_root()}"
                      + (f" ({in_use} in use or being built stay)" if in_use else "") + "?", abort=True)
    data = store.clear(entries, wipe_records)
    removed, kept = data["removed"], data["kept"]
    _out(as_json, data, lambda: console.print(
        f"removed {len(removed)} module(s)" + (f", kept {len(kept)} in use" if kept else "")))


@cache.command("export")
@arch_option
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--variant", "variants", multiple=True, help="only these variants (repeatable)")
@click.option("--include-stale", is_flag=True, help="also pack modules whose variant now renders another URI")
@click.option("--sign", "sign_key", type=click.Path(dir_okay=False), default=None,
              help="sign with this ed25519 private key (default: the key `fivar cache keygen` made, if any)")
@click.option("--no-sign", is_flag=True, help="write an unsigned archive even where a default key exists")
@click.option("--json", "as_json", is_flag=True)
@disk_errors("export the cache")
def export_cmd(file, variants, include_stale, sign_key, no_sign, as_json):
    """Pack this toolchain's current modules (.so, manifest, generated sources) into one .tar.gz. A module whose
    variant was edited since it was built (it now renders another URI, so nothing loads it) stays out unless
    --include-stale. The archive's index (every member's sha256 and size, and what each module is) is signed
    with --sign KEY or the default key: only a signed archive's libraries are imported where that key is
    trusted; an unsigned one gives its importers sources only."""
    data = archive.export(file, variants, include_stale, sign_key, no_sign)
    signer, skipped, stale = data["signed_by"], data["skipped"], data["stale"]
    _out(as_json, data, lambda: console.print(
        f"exported {len(data['modules'])} module(s) to {file}"
        f"{' (replacing the file that was there)' if data['replaced'] else ''} "
        f"({human_size(data['bytes'])}; arch {data['arch']}, flashinfer {data['flashinfer']}, nvcc {data['nvcc']}); "
        + (f"signed by key {signer}" if signer else
           "[yellow]unsigned[/]: importers take its sources only (`fivar cache keygen` makes a signing key)")
        + (f"; skipped {len(skipped)} invalid" if skipped else "")
        + (f"; left out {len(stale)} stale (--include-stale packs them)" if stale else ""), highlight=False))


@cache.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--trust-unsigned", is_flag=True, help="import the libraries of an unsigned or untrusted archive "
              "too (they are native code that runs on load: only for archives you made yourself)")
@click.option("--max-member-size", default="2G", show_default=True, help="largest library an archive may hold")
@click.option("--max-total-size", default="16G", show_default=True, help="largest total an archive may unpack to")
@click.option("--json", "as_json", is_flag=True)
@arch_option
@disk_errors("import the archive")
def import_cmd(file, trust_unsigned, max_member_size, max_total_size, as_json):
    """Unpack an export into FlashInfer's JIT cache; refuses one built for another arch/FlashInfer/nvcc.

    Libraries are imported only from an archive signed by a trusted key (`fivar cache trust`); from an unsigned
    or untrusted one only the C++/CUDA sources are, and the modules build here on first use (--trust-unsigned
    takes the libraries anyway). Per module an archive holds a library, its manifest and the sources the
    manifest lists, which must hash to the module's URI; every member must match the sha256 and size in the
    archive's index. Anything else (a Python file, a file the manifest does not list) refuses the whole archive.
    """
    member_cap, total_cap = store.parse_size(max_member_size), store.parse_size(max_total_size)
    data = archive.import_archive(file, trust_unsigned, member_cap, total_cap, warn=_warn)
    trusted, signer = data["trust"] == "trusted", data["signer"]
    jit_dir, gen_root = store.workspace_dirs()
    present, skipped = data["already_present"], data["skipped"]
    why_not = ("unsigned" if data["trust"] == "unsigned" else f"signed by key {signer}, which is not "
               "trusted here (`fivar cache trust KEY.pub`)")
    _out(as_json, data, lambda: console.print(
        (f"imported {len(data['imported'])} module(s) into {jit_dir}" if trusted or trust_unsigned else
         f"[yellow]{file} is {why_not}[/]: imported the sources of {len(data['sources_only'])} module(s) into "
         f"{gen_root}, not their libraries; they build here on first use (`fivar build --prewarm` builds them "
         "now; --trust-unsigned takes the libraries)") +
        (f" (signed by trusted key {signer})" if trusted else "") +
        (f"; {len(present)} already present" if present else "") +
        "".join(f"; kept {r['uri']} as it is: {r['skipped']}" for r in skipped), highlight=False))


# --------------------------------------------------------------------------------------------- keys

@cache.command("keygen")
@click.option("--out", "out", type=click.Path(dir_okay=False), default=None,
              help="where the private key goes (default: cache_signing_key.pem in FIVAR_CONFIG_DIR or ~/.config/fivar)")
@click.option("--force", is_flag=True, help="replace an existing key")
@click.option("--json", "as_json", is_flag=True)
def keygen_cmd(out, force, as_json):
    """Make an ed25519 key pair for signing exports. The private key is written 0600; share the .pub with the
    machines that import your archives (`fivar cache trust FILE.pub` there). It is trusted here too."""
    from .. import trust
    key, pub, fp = trust.keygen(Path(out) if out else None, force=force)
    data = {"private_key": str(key), "public_key": str(pub), "fingerprint": fp}
    _out(as_json, data, lambda: console.print(
        f"wrote private key {key} (0600) and public key {pub} (fingerprint {fp}); `fivar cache export` signs "
        f"with it{'' if out is None else ' given --sign ' + str(key)}; on importing machines: "
        f"`fivar cache trust {pub.name}`", highlight=False))


@cache.command("trust")
@click.argument("pubkey", required=False, type=click.Path(dir_okay=False))
@click.option("--list", "list_", is_flag=True, help="list the trusted keys")
@click.option("--remove", default=None, help="stop trusting the key with this fingerprint (or its start)")
@click.option("--json", "as_json", is_flag=True)
@disk_errors("change the trusted keys")
def trust_cmd(pubkey, list_, remove, as_json):
    """Trust the public key in PUBKEY: archives it signed import with their libraries. A module imported under a
    key that is later removed no longer loads (it is rebuilt)."""
    from .. import trust
    if sum(map(bool, (pubkey, list_, remove))) != 1:
        raise FivarError("say one of: a public key file to trust, --list, or --remove FINGERPRINT")
    if pubkey:
        fp = trust.trust(Path(pubkey))
        _out(as_json, {"trusted": fp, "dir": str(trust.trusted_dir())}, lambda: console.print(
            f"trusting key {fp} (in {trust.trusted_dir()})", highlight=False))
    elif remove:
        gone = trust.untrust(remove)
        _out(as_json, {"removed": gone.stem}, lambda: console.print(f"no longer trusting key {gone.stem}",
                                                                    highlight=False))
    else:
        keys = sorted(trust.trusted_keys())
        _out(as_json, {"trusted": keys, "dir": str(trust.trusted_dir())}, lambda: console.print(
            "\n".join(keys) if keys else f"no trusted keys in {trust.trusted_dir()}", highlight=False))
