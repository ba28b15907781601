"""SIGTERM/SIGINT: the first signal sets a flag read at the step boundary; a second exits now."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from kiln.checkpointing.unattended.preemption import Preemption
from tests.conftest import REPO


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_sets_the_flag_and_uninstall_restores(sig):
    before = signal.getsignal(sig)
    lines = []
    p = Preemption(log=lines.append)
    assert p.install()
    try:
        assert not p.requested()
        os.kill(os.getpid(), sig)
        assert p.requested() and p.signum == sig
        assert "saving at the end of this step" in lines[0]
    finally:
        p.uninstall()
    assert signal.getsignal(sig) is before


def test_second_signal_exits_at_once():
    code = textwrap.dedent("""
        import os, signal, time
        from kiln.checkpointing.unattended.preemption import Preemption
        p = Preemption(log=lambda s: None)
        p.install()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        print("not reached")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 128 + signal.SIGTERM and "not reached" not in out.stdout
