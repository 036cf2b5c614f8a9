"""Ids of requests and responses: 32 hex digits from Python's ``random``, without a system call.

``uuid.uuid4()`` reads ``os.urandom``, which lets go of the interpreter lock around its system call;
taking the lock back can wait for the engine thread (up to the switch interval, 5 ms), twice per
request. These ids only need to be unique (nothing is authorised by knowing one); ``random``
reseeds itself in a forked child, so processes do not repeat each other's.

>>> len(random_hex())
32
"""
from __future__ import annotations

import random


def random_hex() -> str:
    return f"{random.getrandbits(128):032x}"
