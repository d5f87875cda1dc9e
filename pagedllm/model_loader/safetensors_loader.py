"""Iterating the weights of a Hugging Face folder: every ``*.safetensors`` file (or ``*.bin`` as a fallback)."""

from __future__ import annotations

import glob
import json
import os
from typing import Callable, Iterator, Optional

import torch


def weight_files(folder: str) -> list[str]:
    """The files listed by ``model.safetensors.index.json``, else sorted ``*.safetensors``, else
    ``pytorch_model*.bin`` (the index keeps stray files such as Mistral's ``consolidated.safetensors`` out).

    Raises:
        FileNotFoundError: if the folder has neither.
    """
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return [os.path.join(folder, name) for name in sorted(set(json.load(f)["weight_map"].values()))]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        files = sorted(glob.glob(os.path.join(folder, "pytorch_model*.bin")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {folder!r}")
    return files


def iterate_safetensors_weights(folder: str, skip: Optional[Callable[[str], bool]] = None,
                                ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(name, tensor)`` (checkpoint dtype) for every tensor of every weight file in ``folder``;
    ``skip(name)``: true for tensors not to read at all (another pipeline stage's)."""
    from safetensors import safe_open

    for path in weight_files(folder):
        if path.endswith(".safetensors"):
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if skip is None or not skip(name):
                        yield name, f.get_tensor(name)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
            yield from state.items()
            del state
