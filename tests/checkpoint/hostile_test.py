#!/usr/bin/env python3
"""Hostile checkpoints and hostile save targets (issue 32, the checkpoint classes): each case runs
fsdp-train or checkpoint-tool against a broken copy of a good one-rank checkpoint (or a target
that cannot be written) and checks the exit status, that stderr is ONE line, that it names the
value / path / key, and that nothing hangs (every run is bounded).

Classes: corrupt data found by resharded loads (--tp 2, --dp-shard 2); an overflowing chunk
offset; a malformed xxh64; FIFOs where files are expected (checkpoint.json, a data file of
metadata without 'files'); 300,000 chunks of one key; symlink loops, unreadable directories and
files, checkpoint.json as a directory; malformed PyTorch-style headers; write errors: out of
space (a 64 KiB tmpfs in a private mount namespace, /dev/full), read-only, unwritable and
missing directories.

Permission cases work as root too: the command runs as 'nobody' (setuid in the child). Cases
that need a tmpfs mount (root with CAP_SYS_ADMIN: `unshare -m` + `mount -t tmpfs`) are skipped
with the reason printed when the machine does not allow it; the case count checks what ran.
Usage: hostile_test.py FSDP_TRAIN CHECKPOINT_TOOL"""
import json
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import tempfile

fsdp_train, tool = sys.argv[1], sys.argv[2]
small = ["--backend", "local", "--layers", "2", "--dim", "32", "--heads", "4", "--vocab", "48", "--seq", "16",
         "--batch", "4"]
failures = []
ran = []
skipped = []
NOBODY = 65534


def check(ok, what):
    if not ok:
        failures.append(what)
        print("FAIL:", what)


def run(name, cmd, expect, needles=(), timeout=120, as_nobody=False, wrap=None):
    """Runs cmd; checks the status, one stderr line and each needle in it."""
    full = (wrap or []) + cmd
    kwargs = {}
    if as_nobody and os.geteuid() == 0:
        def drop():
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        kwargs["preexec_fn"] = drop
    try:
        p = subprocess.run(full, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired:
        check(False, f"{name}: still running after {timeout} s (a hang)")
        ran.append(name)
        return None
    lines = p.stderr.strip().splitlines()
    check(p.returncode == expect, f"{name}: exit {p.returncode} (expected {expect}): {p.stderr.strip()[-600:]}")
    if expect != 0:
        check(len(lines) == 1, f"{name}: {len(lines)} stderr lines: {p.stderr[-600:]}")
        for n in needles:
            check(n in p.stderr, f"{name}: stderr lacks {n!r}: {p.stderr.strip()[-600:]}")
    print(f"{name}: exit {p.returncode}: {lines[-1] if lines else ''}")
    ran.append(name)
    return p


def train(*extra, steps=4):
    return [fsdp_train, *small, "--steps", str(steps), *extra]


def losses(p):
    return re.findall(r"^step (\d+)/\d+ loss (\S+)", p.stdout, re.M)


root = tempfile.mkdtemp(prefix="ckpt-hostile-")
os.chmod(root, 0o755)  # the 'nobody' cases traverse it
try:
    run("save", train("--save-dir", os.path.join(root, "ck"), "--save-every", "2"), 0)
    good = os.path.join(root, "ck", "step-00000002")
    meta = json.load(open(os.path.join(good, "checkpoint.json")))
    first_key, first = next(iter(meta["tensors"].items()))
    chunk = first["chunks"][0]
    reference = run("resume good", train("--resume-from", good), 0)
    ref_losses = losses(reference)
    check(len(ref_losses) == 2, f"the good resume printed {ref_losses}")

    def copy(name, edit=None):
        d = os.path.join(root, name)
        shutil.copytree(good, d)
        if edit:
            m = json.load(open(os.path.join(d, "checkpoint.json")))
            edit(m)
            json.dump(m, open(os.path.join(d, "checkpoint.json"), "w"))
        return d

    # 1. Corrupt data: one flipped payload byte near the end of the first tensor, found by the
    # resharded loads (which read part of the chunk) with the default options.
    bad = copy("corrupt")
    with open(os.path.join(bad, chunk["file"]), "r+b") as f:
        f.seek(chunk["byte_offset"] + chunk["nbytes"] - 3)
        b = f.read(1)
        f.seek(chunk["byte_offset"] + chunk["nbytes"] - 3)
        f.write(bytes([b[0] ^ 0x40]))
    for mesh in (["--tp", "2"], ["--dp-shard", "2"], ["--tp", "1"]):
        run(f"corrupt byte, resume {' '.join(mesh)}", train("--resume-from", bad, *mesh), 2,
            ["checksum mismatch", first_key, chunk["file"]])
    run("corrupt byte, export", [tool, "export", bad, os.path.join(root, "corrupt-out")], 2,
        ["checksum mismatch", first_key])

    # 1. An offset whose offset + size overflows int64.
    def huge_offset(m):
        m["tensors"][first_key]["chunks"][0]["offsets"][0] = 9223372036854775807
    d = copy("offset", huge_offset)
    run("offset 2^63-1, resume", train("--resume-from", d), 2, [first_key, "9223372036854775807", "outside"])
    run("offset 2^63-1, export", [tool, "export", d, os.path.join(root, "offset-out")], 2, [first_key, "outside"])

    # 6. A malformed xxh64 names the key.
    def bad_hash(m):
        m["tensors"][first_key]["chunks"][0]["xxh64"] = "not-hex!"
    d = copy("xxh64", bad_hash)
    run("malformed xxh64, info", [tool, "info", d], 2, ["'xxh64'", "not-hex!", first_key])
    run("malformed xxh64, resume", train("--resume-from", d), 2, ["'xxh64'", first_key])

    # 2. FIFOs where files are expected: refused at once, never opened for a blocking read.
    d = copy("fifo-meta")
    os.remove(os.path.join(d, "checkpoint.json"))
    os.mkfifo(os.path.join(d, "checkpoint.json"))
    for what, cmd in (("resume", train("--resume-from", d)), ("info", [tool, "info", d]),
                      ("export", [tool, "export", d, os.path.join(root, "fifo-out")])):
        run(f"FIFO checkpoint.json, {what}", cmd, 2, ["checkpoint.json", "FIFO"], timeout=60)

    def no_files(m):
        del m["files"]
    d = copy("fifo-data", no_files)
    os.remove(os.path.join(d, chunk["file"]))
    os.mkfifo(os.path.join(d, chunk["file"]))
    run("FIFO data file (no 'files'), resume", train("--resume-from", d), 2, [chunk["file"], "FIFO"], timeout=60)
    run("FIFO data file (no 'files'), export", [tool, "export", d, os.path.join(root, "fifo-data-out")], 2,
        [chunk["file"], "FIFO"], timeout=60)
    run("FIFO data file (no 'files'), info", [tool, "info", d], 0, timeout=60)  # reads metadata only

    # 2. 300,000 empty chunks of one key: the coverage check is O(n log n) (once over 90 s).
    def many_chunks(m):
        c = dict(m["tensors"][first_key]["chunks"][0])
        sizes = list(c["sizes"])
        sizes[0] = 0
        empty = {"offsets": [0] * len(sizes), "sizes": sizes, "file": c["file"], "byte_offset": 0, "nbytes": 0,
                 "xxh64": "ef46db3751d8e999"}
        m["tensors"][first_key]["chunks"] += [empty] * 300000
    d = copy("many", many_chunks)
    p = run("300,000 empty chunks, resume", train("--resume-from", d), 0, timeout=120)
    if p:
        check(losses(p) == ref_losses, f"300,000 empty chunks: losses {losses(p)} vs {ref_losses}")
    run("300,000 empty chunks, export", [tool, "export", d, os.path.join(root, "many-out")], 0, timeout=120)

    # 4. checkpoint-tool on broken directories: each exits 2 naming the path.
    loop = os.path.join(root, "loop")
    os.symlink(loop, loop)
    run("symlink loop, info", [tool, "info", loop], 2, [loop, "Too many levels of symbolic links"])
    run("symlink loop, export", [tool, "export", loop, os.path.join(root, "loop-out")], 2, [loop])
    d = copy("meta-dir")
    os.remove(os.path.join(d, "checkpoint.json"))
    os.mkdir(os.path.join(d, "checkpoint.json"))
    run("checkpoint.json is a directory, info", [tool, "info", d], 2, ["checkpoint.json", "a directory"])
    run("checkpoint.json is a directory, resume", train("--resume-from", d), 2, ["checkpoint.json", "a directory"])
    # Unreadable: run as 'nobody' (root reads everything).
    d = copy("unreadable-dir")
    os.chmod(d, 0o000)
    run("unreadable directory, info", [tool, "info", d], 2, [d, "Permission denied"], as_nobody=True)
    run("unreadable directory, export", [tool, "export", d, os.path.join(root, "x")], 2, [d, "Permission denied"],
        as_nobody=True)
    os.chmod(d, 0o755)
    d = copy("unreadable-meta")
    os.chmod(os.path.join(d, "checkpoint.json"), 0o000)
    run("unreadable checkpoint.json, info", [tool, "info", d], 2, ["checkpoint.json", "Permission denied"],
        as_nobody=True)
    run("unreadable checkpoint.json, resume", train("--resume-from", d), 2, ["checkpoint.json", "Permission denied"],
        as_nobody=True)

    # 4. Malformed PyTorch-style (foreign) headers: exit 2 naming the file.
    def foreign(name, header, data=b"\0" * 16):
        d = os.path.join(root, name)
        os.mkdir(d)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(os.path.join(d, "model-00001-of-00001.safetensors"), "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text + data)
        return d

    entry = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    sharding = json.dumps({"w": {"saved_offsets": [0, 0]}})
    ok = foreign("foreign-ok", {"__metadata__": {"DCP_SHARDING_INFO": sharding, "format": "pt"}, "w": entry})
    run("foreign, well formed", [tool, "info", ok], 0)
    for name, header, needles in (
            ("non-JSON DCP_SHARDING_INFO", {"__metadata__": {"DCP_SHARDING_INFO": "{not json"}, "w": entry},
             ["DCP_SHARDING_INFO", "not JSON"]),
            ("entry without dtype", {"w": {"shape": [2, 2], "data_offsets": [0, 16]}}, ["'w'", "'dtype' is missing"]),
            ("string saved_offsets", {"__metadata__": {"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": "0,0"}})},
                                      "w": entry}, ["'w'", "saved_offsets"]),
            ("header is an array", [1, 2, 3], ["expected a JSON object"]),
            ("data offsets past the end", {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 2**64 - 1]}},
             ["'w'", "data_offsets"])):
        d = foreign("foreign-" + re.sub(r"\W", "-", name), header)
        for what, cmd in (("info", [tool, "info", d]), ("export", [tool, "export", d, d + "-out"])):
            run(f"foreign: {name}, {what}", cmd, 2, ["model-00001-of-00001.safetensors", *needles])

    # 4. Write errors. /dev/full: out of space at the file level (no privileges needed).
    run("--dump-init /dev/full", train("--dump-init", "/dev/full", steps=1), 3,
        ["/dev/full", "No space left on device", "bytes"])
    out = os.path.join(root, "export-full")
    os.mkdir(out)
    os.symlink("/dev/full", os.path.join(out, "model.safetensors"))
    run("export onto /dev/full", [tool, "export", good, out], 3, ["model.safetensors", "No space left on device",
                                                                  "bytes"])
    # Missing, not-a-directory and unwritable paths: 2 naming the path.
    missing = os.path.join(root, "no-such-dir", "init.safetensors")
    run("--dump-init into a missing directory", train("--dump-init", missing, steps=1), 2,
        [missing, "No such file or directory"])
    plain = os.path.join(root, "plain-file")
    open(plain, "w").write("x")
    run("--save-dir under a regular file", train("--save-dir", os.path.join(plain, "ck"), "--save-every", "2"), 2,
        [plain, "Not a directory"])
    run("export under a regular file", [tool, "export", good, os.path.join(plain, "out")], 2,
        [plain, "Not a directory"])
    locked = os.path.join(root, "locked")
    os.mkdir(locked, 0o755)  # root's: 'nobody' cannot write into it
    run("--save-dir unwritable (as nobody)", train("--save-dir", locked, "--save-every", "2"), 2,
        [locked, "Permission denied"], as_nobody=True)
    run("--save-dir unwritable, async (as nobody)", train("--save-dir", locked, "--save-every", "2", "--async-save"),
        2, [locked, "Permission denied"], as_nobody=True)
    run("export unwritable (as nobody)", [tool, "export", good, os.path.join(locked, "out")], 2,
        [locked, "Permission denied"], as_nobody=True)

    # Full and read-only filesystems: a 64 KiB tmpfs in a private mount namespace (root only).
    mnt = os.path.join(root, "mnt")
    os.mkdir(mnt)
    mount_ok = shutil.which("unshare") and subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {mnt}"],
        capture_output=True).returncode == 0

    def in_tmpfs(options):
        return ["unshare", "-m", "--propagation", "private", "sh", "-c",
                'mount -t tmpfs -o "$1" tmpfs "$2" && shift 2 && exec "$@"', "sh", options, mnt]

    tmpfs_cases = [
        ("--save-dir on a full filesystem", train("--save-dir", mnt, "--save-every", "2"), "size=64k", 3,
         [mnt, "No space left on device", "bytes"]),
        ("--save-dir on a full filesystem, async", train("--save-dir", mnt, "--save-every", "2", "--async-save"),
         "size=64k", 3, [mnt, "No space left on device", "bytes"]),
        ("export onto a full filesystem", [tool, "export", good, os.path.join(mnt, "out")], "size=64k", 3,
         [mnt, "No space left on device", "bytes"]),
        ("--save-dir on a read-only filesystem", train("--save-dir", os.path.join(mnt, "ck"), "--save-every", "2"),
         "ro,size=64k", 2, [mnt, "Read-only file system"]),
        ("export onto a read-only filesystem", [tool, "export", good, mnt], "ro,size=64k", 2,
         [mnt, "Read-only file system"]),
    ]
    for name, cmd, options, status, needles in tmpfs_cases:
        if mount_ok:
            run(name, cmd, status, needles, wrap=in_tmpfs(options))
        else:
            skipped.append(f"{name} (no tmpfs mount: needs root with CAP_SYS_ADMIN and unshare)")

    for s in skipped:
        print("SKIP:", s)
    expected = 50
    check(len(ran) + len(skipped) == expected, f"{len(ran)} cases ran and {len(skipped)} were skipped, "
                                               f"expected {expected} in all")
finally:
    for dirpath, dirnames, _ in os.walk(root):
        for n in dirnames:
            try:
                os.chmod(os.path.join(dirpath, n), 0o755)
            except OSError:
                pass
    shutil.rmtree(root, ignore_errors=True)
print(f"hostile_test: {len(ran)} cases ran, {len(skipped)} skipped, {len(failures)} failures")
sys.exit(1 if failures else 0)
