"""Everything on one device (chapter 01): the interface's defaults, nothing overridden.

Read distlab.strategies.base for the hooks; every other strategy says what it changes against
this one."""

from __future__ import annotations

from distlab.strategies.base import Strategy


class SingleDevice(Strategy):
    name = "single"
