#!/usr/bin/env python
"""Print (or write) the patch table of the installed megatron-core: the CUDA call sites of
each proxied module and the source fingerprints of every function patches/ relies on.

After installing a new megatron-core release: run this, review every function it reports as
changed, new or gone against the previous release's table (`--against 0.16.1`), adapt the
patches if needed, then `--write` the table to patches/releases/ and add the release to
SUPPORTED_RELEASES in patches/sites.py (tests/test_patches.py checks them).
"""
import argparse
import json
import sys

from megatron_calibclip.patches import fingerprint, sites


def build_table(base: dict) -> dict:
    """The installed release's table, for the modules and replaced functions of `base`."""
    modules = {m: fingerprint.cuda_sites(m) for m in base["proxied_modules"]}
    table = {"megatron_core": sites.installed_release(), "proxied_modules": modules,
             "replaced_functions": list(base["replaced_functions"])}
    prints = {}
    for site in sites.all_patched_sites(table):
        try:
            prints[site] = fingerprint.source_fingerprint(site)
        except LookupError as err:  # a replaced function that is gone: the patches must change
            raise SystemExit(f"patch_fingerprints: {err}") from None
    table["fingerprints"] = prints
    return table


def changes(old: dict, new: dict) -> list[str]:
    """One line per site that is new, gone or changed between two tables."""
    lines = []
    for site in sorted(set(old["fingerprints"]) | set(new["fingerprints"])):
        a, b = old["fingerprints"].get(site), new["fingerprints"].get(site)
        if a != b:
            lines.append(f"{'new' if a is None else 'gone' if b is None else 'changed'}: {site}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default=sites.SUPPORTED_RELEASES[0],
                        help="release whose modules/replaced functions to use and to diff with")
    parser.add_argument("--write", action="store_true", help="write patches/releases/megatron-core-<v>.json")
    args = parser.parse_args(argv)
    base = sites.release_table(args.against)
    table = build_table(base)
    for line in changes(base, table):
        print(line, file=sys.stderr)
    text = json.dumps(table, indent=1) + "\n"
    if args.write:
        path = sites.RELEASES_DIR / f"megatron-core-{table['megatron_core']}.json"
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}", file=sys.stderr)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
