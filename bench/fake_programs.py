"""What the offline tests of the torch comparison scripts share (test_torch_fsdp_compare.py,
test_torch_moe_compare.py; no torch and no C++ build needed):

- Checks: the "ok    " / "FAIL  " log of each check and the final "passed" / "FAILED" line;
- install_fake: a small Python program standing in for one of our binaries in a temporary build
  directory, which first appends its command line (a JSON list) to the file named by an
  environment variable; read_calls reads those lines back;
- imports_torch: whether importing the scripts imports torch (it must not: CI has no torch).

Example:
    check = Checks()
    exe = install_fake(build, "examples/fsdp-train", 'print("step 1/1 loss 4 ms 1")\\n')
    os.environ["FAKE_LOG"] = log
    ...                                    # the script under test runs exe
    check(len(read_calls(log)) == 1, "fsdp-train ran once")
    return check.finish()                  # 0 when every check passed, else 1
"""

import json
import os
import stat
import subprocess
import sys


class Checks:
    def __init__(self):
        self.failures = []

    def __call__(self, cond, what):
        print(("ok    " if cond else "FAIL  ") + what)
        if not cond:
            self.failures.append(what)

    def finish(self):
        """Prints the summary line; the exit status: 1 if any check failed."""
        print(f"{'FAILED' if self.failures else 'passed'}: {len(self.failures)} failure(s)")
        return 1 if self.failures else 0


# The fake's first lines: `args` (its command line) is logged, json, os and sys are imported.
_HEADER = '''#!/usr/bin/env python3
import json, os, sys
args = sys.argv[1:]
with open(os.environ[{log_env!r}], "a") as f:
    f.write(json.dumps(args) + "\\n")
'''


def install_fake(build, rel_path, body, log_env="FAKE_LOG"):
    """Writes build/rel_path, an executable Python program: the header above (logging to the file
    named by $log_env), then body. Returns its path."""
    path = os.path.join(build, rel_path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(_HEADER.format(log_env=log_env) + body)
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    return path


def read_calls(log):
    """The command lines a fake logged, in order (a list of argument lists)."""
    with open(log) as f:
        return [json.loads(line) for line in f]


def imports_torch(here, *modules):
    """True when importing `modules` from the directory `here` (in a fresh interpreter) imports torch."""
    probe = (f"import sys; sys.path.insert(0, sys.argv[1]); import {', '.join(modules)}; "
             "sys.exit(1 if 'torch' in sys.modules else 0)")
    return subprocess.run([sys.executable, "-c", probe, here]).returncode != 0
