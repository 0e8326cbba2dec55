"""Saved layer inputs kept in host memory: the one activation per layer that gradient checkpointing
holds from forward to backward, moved off the accelerator.

Under non-reentrant checkpointing (`torch.utils.checkpoint`, as transformers uses it) a checkpointed
layer keeps only its inputs, and it keeps them as saved tensors: a `saved_tensors_hooks` pair active
around the checkpointed call sees exactly them (the layer's own saved activations go to the
checkpoint's inner hooks). `HostOffload` is that pair. On a GPU each input is copied to pinned host
memory on a side stream, so the copy overlaps the next layer's compute; the device tensor is released
to the caching allocator once the copy is done (`record_stream`), and backward copies it back on the
current stream before the layer is recomputed. A tensor already in host memory (CPU training) stays
where it is. (transformers' own `activation_checkpointing_enable(offload=True)` copies on the compute
stream and only when it enables checkpointing itself; these hooks work whoever enables it.)
"""

from __future__ import annotations

import torch


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors of accelerator devices go to host memory while they wait for backward.

    Use around a checkpointed call: `with HostOffload(): layer(x)`. `copy_host_tensors=True` also
    copies tensors that are already on the host (tests: the offloaded copy is then what backward
    reads, and the original is released)."""

    def __init__(self, copy_host_tensors: bool = False) -> None:
        self.copy_host_tensors = copy_host_tensors
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # one copy stream per device
        super().__init__(self._pack, self._unpack)

    def __reduce__(self):
        # a copy (a model copied with its offloading layers) starts without this process's copy streams
        return HostOffload, (self.copy_host_tensors,)

    def _pack(self, tensor: torch.Tensor):
        if tensor.device.type == "cpu":
            return (None, tensor.detach().clone() if self.copy_host_tensors else tensor, None)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda)
        if not tensor.is_cuda:
            host.copy_(tensor)
            return (tensor.device, host, None)
        if tensor.device not in self._streams:
            self._streams[tensor.device] = torch.cuda.Stream(tensor.device)
        stream = self._streams[tensor.device]
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        tensor.record_stream(stream)  # its memory is reused only once the copy has finished
        return (tensor.device, host, done)

    @staticmethod
    def _unpack(packed) -> torch.Tensor:
        device, host, done = packed
        if device is None:
            return host
        if done is None:
            return host.to(device)
        torch.cuda.current_stream(device).wait_event(done)
        return host.to(device, non_blocking=True)

