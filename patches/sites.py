"""What the CPU patches rely on in each supported megatron-core release: the functions holding
CUDA-only call sites (per proxied module), the functions replaced or wrapped outright, and a
fingerprint of each one's source.

One JSON table per release (patches/releases/megatron-core-<version>.json), written by
tools/patch_fingerprints.py after a review of every changed function (patches/README.md);
tests/test_patches.py compares the installed megatron-core with its release's table. Why
tables and not version checks in the patch code: the patches themselves are the same for every
supported release (they change what `torch` means inside megatron's modules, not megatron's
lines); only the list of sites to watch differs.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from megatron_calibclip.compat import megatron_line, megatron_version

RELEASES_DIR = Path(__file__).with_name("releases")



def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else 0 for p in version.split("."))


# The releases we test, one per supported line (docs/versions.md): 0.16.x on Python 3.11,
# 0.19.x on Python 3.12 (0.17+ wheels need Python >= 3.12). A release is supported when its
# reviewed table is here: the files are the one list.
SUPPORTED_RELEASES: tuple[str, ...] = tuple(sorted(
    (p.name[len("megatron-core-"):-len(".json")] for p in RELEASES_DIR.glob("megatron-core-*.json")),
    key=_version_key))


# megatron-core's release from its package metadata (megatron itself is not imported)
installed_release = megatron_version


def table_release(version: str) -> str:
    """The supported release whose table serves `version`: itself if supported, else the newest
    supported release of an earlier or equal line (the patches warn that it is untested)."""
    if version in SUPPORTED_RELEASES:
        return version
    line = _version_key(megatron_line(version))
    earlier = [r for r in SUPPORTED_RELEASES if _version_key(megatron_line(r)) <= line]
    return earlier[-1] if earlier else SUPPORTED_RELEASES[0]


@lru_cache(maxsize=None)
def release_table(release: str) -> dict:
    """The table of one supported release: {megatron_core, proxied_modules, replaced_functions,
    fingerprints}."""
    path = RELEASES_DIR / f"megatron-core-{release}.json"
    if not path.exists():
        raise LookupError(f"no patch table for megatron-core {release} (supported: "
                          f"{', '.join(SUPPORTED_RELEASES)})")
    return json.loads(path.read_text(encoding="utf-8"))


_TABLE = release_table(table_release(installed_release()))

# The table of the installed release, under the names the patches and tests use.
MADE_FOR_MEGATRON_CORE: str = _TABLE["megatron_core"]
PROXIED_MODULES: dict[str, list[str]] = _TABLE["proxied_modules"]
REPLACED_FUNCTIONS: list[str] = _TABLE["replaced_functions"]
FINGERPRINTS: dict[str, str] = _TABLE["fingerprints"]


def all_patched_sites(table: dict | None = None) -> list[str]:
    """Every megatron function whose source the patches rely on, as 'module:qualname'."""
    table = table or _TABLE
    sites = [f"{m}:{f}" for m, fns in table["proxied_modules"].items() for f in fns]
    return sites + list(table["replaced_functions"])
