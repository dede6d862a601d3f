"""Whose native code fivar loads: ed25519 keys for shared cache archives (`fivar cache keygen / trust / export
--sign / import`).

A module's `.so` runs its constructors the moment it is loaded, and a sha256 that an archive carries about
itself proves nothing. So an archive's index (`fivar_export.json`: every member's sha256 and size, and every
field that decides what runs) is signed with the exporter's private key, and an import takes libraries only
from an archive whose signature verifies against a key the user trusts. Keys live in the user's config dir
(FIVAR_CONFIG_DIR, else $XDG_CONFIG_HOME/fivar, else ~/.config/fivar): the private key `cache_signing_key.pem`
(0600), its public half `cache_signing_key.pub`, and one `trusted_keys/<fingerprint>.pub` per trusted key.
`cryptography` is imported only to make, sign or verify.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import FivarError

KEY_NAME = "cache_signing_key.pem"
PUB_NAME = "cache_signing_key.pub"
TRUSTED_DIR = "trusted_keys"
PUB_PREFIX = "fivar-ed25519"
SIG_FORMAT = "fivar-signature/1"


def config_dir() -> Path:
    from .config import config_dir_setting
    given = config_dir_setting()
    if given:
        return Path(given)
    xdg = os.environ.get("XDG_CONFIG_HOME")
    return (Path(xdg) if xdg else Path.home() / ".config") / "fivar"


def default_key_path() -> Path:
    return config_dir() / KEY_NAME


def trusted_dir() -> Path:
    return config_dir() / TRUSTED_DIR


def fingerprint(raw: bytes) -> str:
    """What names a public key in messages and in trusted_keys/: 32 hex digits of its sha256."""
    return hashlib.sha256(raw).hexdigest()[:32]


def public_key_text(raw: bytes, comment: str = "") -> str:
    return f"{PUB_PREFIX} {base64.b64encode(raw).decode()} {comment}".rstrip() + "\n"


def parse_public_key(text: str, where) -> bytes:
    """The 32 raw bytes of a `fivar-ed25519 <base64> [comment]` line; one-line FivarError otherwise."""
    parts = text.split()
    try:
        if len(parts) < 2 or parts[0] != PUB_PREFIX:
            raise ValueError
        raw = base64.b64decode(parts[1], validate=True)
        if len(raw) != 32:
            raise ValueError
    except ValueError:
        raise FivarError(f"{where} is not a fivar public key (one line: '{PUB_PREFIX} <base64 of 32 bytes>'; "
                         "`fivar cache keygen` writes one)") from None
    return raw


def _write_private(path: Path, data: bytes) -> None:
    """Written 0600 from the first byte (never readable by others, not even briefly), then renamed in place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_public(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def keygen(path: Path | None = None, force: bool = False) -> tuple[Path, Path, str]:
    """A new key pair: the private key at `path` (default: the config dir's), its public half beside it as
    `.pub`. The new key is trusted here too (archives this user signs import here). Returns (key, pub, fp)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    path = Path(path) if path else default_key_path()
    pub_path = path.parent / PUB_NAME if path == default_key_path() else path.with_name(path.name + ".pub")
    if path.exists() and not force:
        raise FivarError(f"a key already exists at {path}; --force replaces it (archives signed with it then no "
                         "longer import where only it was trusted)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
        raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        _write_private(path, pem)
        _write_public(pub_path, public_key_text(raw, f"fivar cache key {fingerprint(raw)}"))
    except OSError as e:
        raise FivarError(f"cannot write the key at {e.filename or path} ({e.strerror}); set FIVAR_CONFIG_DIR to a "
                         "writable directory") from None
    trust(pub_path)
    return path, pub_path, fingerprint(raw)


def load_private_key(path: Path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise FivarError(f"cannot read the signing key {path} ({e.strerror}); `fivar cache keygen` makes one") \
            from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        key = None
    if not isinstance(key, Ed25519PrivateKey):
        raise FivarError(f"{path} is not an unencrypted ed25519 private key in PEM (what `fivar cache keygen` "
                         "writes)")
    return key


def trust(pub_path: Path) -> str:
    """Trust the public key in `pub_path`: archives it signed import with their libraries. Returns its
    fingerprint."""
    try:
        text = Path(pub_path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise FivarError(f"cannot read the public key {pub_path} ({getattr(e, 'strerror', None) or e})") from None
    raw = parse_public_key(text, pub_path)
    fp = fingerprint(raw)
    try:
        trusted_dir().mkdir(parents=True, exist_ok=True)
        _write_public(trusted_dir() / f"{fp}.pub", public_key_text(raw, text.split(None, 2)[2].strip()
                                                                   if len(text.split(None, 2)) > 2 else ""))
    except OSError as e:
        raise FivarError(f"cannot add the key to {trusted_dir()} ({e.strerror}); set FIVAR_CONFIG_DIR to a "
                         "writable directory") from None
    return fp


def untrust(fp: str) -> Path:
    hits = [p for p in trusted_dir().glob("*.pub") if p.stem.startswith(fp)] if fp else []
    if len(hits) != 1:
        raise FivarError(f"{'no' if not hits else len(hits)} trusted key(s) with fingerprint {fp!r} in "
                         f"{trusted_dir()} (`fivar cache trust --list` lists them)")
    hits[0].unlink()
    return hits[0]


def trusted_keys() -> dict[str, bytes]:
    """fingerprint -> raw public key, for every readable key in trusted_keys/ (a file that does not parse, or
    whose name is not its fingerprint, is not trusted)."""
    out = {}
    for p in sorted(trusted_dir().glob("*.pub")) if trusted_dir().is_dir() else []:
        try:
            raw = parse_public_key(p.read_text(), p)
        except (OSError, UnicodeDecodeError, FivarError):
            continue
        if fingerprint(raw) == p.stem:
            out[p.stem] = raw
    return out


def is_trusted(fp: str) -> bool:
    """Whether the key `fp` is still trusted (a module imported under a key the user has since removed no
    longer loads: it is rebuilt)."""
    if not isinstance(fp, str) or not re.fullmatch(r"[0-9a-f]{32}", fp):
        return False
    try:  # one file, not the whole directory: this runs on every load of an imported module
        return fingerprint(parse_public_key((trusted_dir() / f"{fp}.pub").read_text(), fp)) == fp
    except (OSError, UnicodeDecodeError, FivarError):
        return False


def sign(index: bytes, key_path: Path) -> tuple[bytes, str]:
    """A detached signature document over the exact bytes of an archive's index, and the signer's fingerprint."""
    from cryptography.hazmat.primitives import serialization
    key = load_private_key(key_path)
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    doc = {"format": SIG_FORMAT, "algorithm": "ed25519", "public_key": base64.b64encode(raw).decode(),
           "signature": base64.b64encode(key.sign(index)).decode()}
    return json.dumps(doc, indent=1).encode(), fingerprint(raw)


@dataclass
class Verdict:
    #: 'trusted' (signed by a trusted key), 'untrusted' (a valid signature by a key not trusted here), 'unsigned'
    status: str
    signer: str | None = None


def check(index: bytes, signature: bytes | None, where) -> Verdict:
    """Who vouches for the index bytes. A signature that does not verify (the index was changed after signing,
    or the document is malformed) is a FivarError: the archive was tampered with."""
    if signature is None:
        return Verdict("unsigned")
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    try:
        doc = json.loads(signature)
        if not isinstance(doc, dict) or doc.get("format") != SIG_FORMAT or doc.get("algorithm") != "ed25519":
            raise ValueError
        raw = base64.b64decode(doc["public_key"], validate=True)
        sig = base64.b64decode(doc["signature"], validate=True)
        Ed25519PublicKey.from_public_bytes(raw).verify(sig, index)
    except InvalidSignature:
        raise FivarError(f"{where}: the signature does not match the archive's index (altered after signing); "
                         "refusing to import") from None
    except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: JSON nested too deep to read
        raise FivarError(f"{where}: the signature file is malformed (expected {SIG_FORMAT}, ed25519); refusing "
                         "to import") from None
    fp = fingerprint(raw)
    return Verdict("trusted" if fp in trusted_keys() else "untrusted", fp)
