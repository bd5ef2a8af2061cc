"""The environment of a program run by the CLI tests. Under AddressSanitizer (tools/sanitizers.sh
sets ASAN_OPTIONS) a process that starts MPI needs full unwinding on malloc: OpenMPI unloads its
plugins before LeakSanitizer reports, so with the fast unwinder its leaks show only frames of
unloaded modules, which tools/sanitizers/lsan.supp cannot match. Everything else keeps the fast
unwinder (full unwinding makes allocation-heavy runs ten times slower)."""
import os


def child_env(argv):
    env = dict(os.environ)
    uses_mpi = any(a == "--backend" and b == "mpi" for a, b in zip(argv, argv[1:]))
    if uses_mpi and "ASAN_OPTIONS" in env:
        env["LSAN_OPTIONS"] = env.get("LSAN_OPTIONS", "") + ":fast_unwind_on_malloc=0"
    return env
