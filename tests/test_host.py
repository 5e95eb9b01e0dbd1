"""portable_ssm.host: retaining freed memory (glibc mallopt) stops the page faults of reallocated
temporaries, checks its limit, changes nothing without glibc, and the command line applies it
unless PORTABLE_SSM_RETAIN_MEMORY=0."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import portable_ssm as ps
from portable_ssm import cli, host

#: Six 8 MiB arrays made, written and freed ten times: with glibc's defaults the 48 MiB freed at
#: the top of the heap is handed back each time, and the next round faults every page in again.
CHURN = textwrap.dedent("""
    import resource, sys
    import numpy as np
    import portable_ssm as ps

    def churn():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(10):
            arrays = [np.ones(2 * 1024 * 1024, dtype=np.float32) for _ in range(6)]
            del arrays
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    churn()
    default = churn()
    retained = ps.retain_freed_memory()
    churn()
    print(default, retained, churn())
""")


def test_retained_memory_is_reused_without_page_faults():
    done = subprocess.run([sys.executable, "-c", CHURN], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    default, retained, after = done.stdout.split()
    if retained != "True":
        pytest.skip("the C library is not glibc: retain_freed_memory changes nothing")
    # 48 MiB of 4 KiB pages is 12288 faults a round where the kernel maps them afresh
    assert int(default) > 10 * 1000 and int(after) < 100, (default, after)


@pytest.mark.parametrize("limit, error", [("1024", TypeError), (True, TypeError), (1.5, TypeError),
                                          (0, ValueError), (-1, ValueError), (2 ** 31, ValueError)])
def test_retain_freed_memory_names_a_bad_limit(limit, error):
    with pytest.raises(error, match="limit"):
        ps.retain_freed_memory(limit)


def test_retain_freed_memory_changes_nothing_without_glibc(monkeypatch):
    monkeypatch.setattr(host, "_glibc", lambda: None)
    assert ps.retain_freed_memory() is False


@pytest.mark.parametrize("value, calls", [(None, 1), ("1", 1), ("0", 0)])
def test_the_command_line_retains_freed_memory_unless_told_not_to(monkeypatch, capsys, value, calls):
    seen = []
    monkeypatch.setattr(host, "retain_freed_memory", lambda: seen.append(True) or True)
    if value is None:
        monkeypatch.delenv(host.ENV, raising=False)
    else:
        monkeypatch.setenv(host.ENV, value)
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert len(seen) == 0  # argparse's --version exits before any command runs
    assert cli.main(["info", "/nonexistent/model"]) == cli.ERROR_STATUS
    assert len(seen) == calls


def test_a_bad_retain_setting_is_one_error_line(monkeypatch, capsys):
    monkeypatch.setenv(host.ENV, "yes")
    assert cli.main(["info", "/nonexistent/model"]) == cli.ERROR_STATUS
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("portable-ssm info: error: PORTABLE_SSM_RETAIN_MEMORY"), err
    assert "'yes'" in err
