"""Fixtures the cluster tests share."""

from __future__ import annotations

import pytest

from kvtest import OperatorProcess


@pytest.fixture
def operator(cluster, crd_installed, namespace):
    """The operator as a subprocess, scoped to the test's namespace; its log is printed after the test."""
    proc = OperatorProcess(cluster.env, [namespace])
    yield proc
    proc.stop()
    print(proc.output()[-5000:])
