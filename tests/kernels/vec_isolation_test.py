#!/usr/bin/env python3
"""NOTE [isa variants] (kernels/cpu/vec.h): the AVX2 / AVX-512 variants of the compute primitives
are compiled with their own -march, so none of their symbols may be shared with the rest of the
library: an inline function or template instantiated there with AVX-512 instructions could be
picked by the linker for baseline code and crash on a CPU without AVX-512 (a One Definition Rule
violation the linker cannot see). Checks that every weak or unique symbol the variant archives
define lives in the variant's own namespaces.

    vec_isolation_test.py NM ARCHIVE...
"""
import re
import subprocess
import sys

ALLOWED = re.compile(r"(KernelsEigen(Avx2|Avx512|Baseline)|kernels::detail::vec_(avx2|avx512|baseline))")
# The C++ runtime's own personality reference is always emitted as a weak hidden symbol.
IGNORED = {"DW.ref.__gxx_personality_v0"}


def main():
    nm, archives = sys.argv[1], sys.argv[2:]
    if not archives:
        print("vec_isolation_test: no variant archives built (not x86-64): nothing to check")
        return 0
    bad = []
    checked = 0
    for archive in archives:
        out = subprocess.run([nm, "-C", "--defined-only", archive], check=True, capture_output=True,
                             text=True).stdout
        for line in out.splitlines():
            parts = line.split(None, 2)
            if len(parts) != 3:
                continue
            kind, name = parts[1], parts[2]
            checked += 1
            if kind in "WVu" and name not in IGNORED and not ALLOWED.search(name):
                bad.append(f"{archive}: {kind} {name}")
    for b in bad:
        print("shared symbol:", b)
    print(f"vec_isolation_test: {checked} symbols in {len(archives)} archive(s), {len(bad)} shared")
    if checked == 0:
        print("vec_isolation_test: no symbols read: the check cannot have worked")
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
