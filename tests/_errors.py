"""Checking the errors DCP raises, across the torch versions kvckpt supports."""

from __future__ import annotations

import contextlib
import logging
import re

import pytest


@contextlib.contextmanager
def load_fails(caplog: pytest.LogCaptureFixture, pattern: str):
    """A DCP call that must fail with the reader's error matching ``pattern``.

    torch >= 2.13 puts the reader's ``read_metadata`` error in the exception it raises. torch
    2.10-2.12 swallow it and raise a bare "metadata is None"; there kvckpt's own warning
    ("kvckpt cannot load from ...") must hold it.
    """
    with caplog.at_level(logging.WARNING, logger="kvckpt"), pytest.raises(BaseException) as info:
        yield info
    text = str(info.value)
    if "metadata is None" in text and "failed:" not in text:
        text = caplog.text
        assert "kvckpt cannot load from" in text, text
    assert re.search(pattern, text, re.S), text
