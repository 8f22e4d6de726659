"""Compatibility name for :mod:`ctxmem_common.flash_format`, the one home of the on-flash
format and its reader: kept only so existing ``from ctxmem_dpu.tiers.flash_format import``
lines keep working; new code imports ``ctxmem_common.flash_format``."""

from ctxmem_common.flash_format import *  # noqa: F403
from ctxmem_common.flash_format import __all__ as __all__
