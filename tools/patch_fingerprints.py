#!/usr/bin/env python
"""Print the CUDA call sites and source fingerprints of the megatron-core functions that
patches/ relies on, in the form of the tables in patches/sites.py.

Run after changing the pinned megatron-core; review every changed function, adapt the
patches if needed, then paste the new tables (tests/test_patches.py checks them).
"""
import json

from megatron_calibclip import patches


def main() -> None:
    sites = {module: patches.cuda_sites(module) for module in patches.PROXIED_MODULES}
    print("PROXIED_MODULES =", json.dumps(sites, indent=4))
    fingerprints = {s: patches.source_fingerprint(s) for s in patches.all_patched_sites()}
    print("FINGERPRINTS =", json.dumps(fingerprints, indent=4))


if __name__ == "__main__":
    main()
