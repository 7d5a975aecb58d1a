"""Dropping root for the attack workers: they import what they need as root,
then become another uid for good (groups, real, effective and saved ids)."""

from __future__ import annotations

import os


def drop_to(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    assert os.getresuid() == (uid, uid, uid)
