"""Host decisions that must not read a device tensor.

Reading a CUDA tensor's value on the host (``bool(t.any())``, ``.item()``, ``.tolist()``,
``nonzero``) waits for every kernel queued before it, which stalls the launch pipeline on every
call. The ops make such decisions only for CPU tensors, where they are free; on any other device
they take the path that is correct either way, or check on the device.
"""
from __future__ import annotations

import torch


def on_host(t: torch.Tensor) -> bool:
    """True when ``t``'s values can be read without synchronising with a device."""
    return t.device.type == "cpu"


def any_or_device(t: torch.Tensor) -> bool:
    """``bool(t.any())`` for CPU tensors; True on other devices, without reading ``t`` (the caller
    then runs the branch that is also correct when nothing is set)."""
    return not on_host(t) or bool(t.any())


def check_on_device(ok: torch.Tensor, message: str) -> None:
    """Raise ``ValueError(message)`` unless every entry of the boolean tensor ``ok`` is True: at
    once for CPU tensors, asynchronously on other devices (``torch._assert_async``: the device
    reports the failure when the stream reaches it, with the message)."""
    if on_host(ok):
        if not bool(ok.all()):
            raise ValueError(message)
    else:
        torch._assert_async(ok.all(), device_message(message))


#: torch._assert_async refuses a message of this many characters or more on CUDA ("Message length
#: must be smaller than 255"), which failed every xPos rotary call on an H200.
DEVICE_MESSAGE_LIMIT = 255


def device_message(message: str) -> str:
    """``message`` cut to what the device assertion carries; its start (the op and the argument)
    is kept."""
    if len(message) < DEVICE_MESSAGE_LIMIT:
        return message
    return message[:DEVICE_MESSAGE_LIMIT - 4] + "..."
