"""Loading a Hugging Face causal LM from a local folder, one load at a time per process.

transformers builds a model on the ``meta`` device and then fills it from the checkpoint; two
loads running at once in one process (a rollout worker restarting while the trainer loads, two
stations of one node) interfere in that step: some come back with parameters still on ``meta``
("Cannot copy out of meta tensor") or a tied ``lm_head`` reported missing and initialised anew.
Every load of the library goes through :func:`load_causal_lm`, which serialises them with a
process-wide lock (a load is seconds, done once per role start: nothing worth running in
parallel). Imports transformers (the ``hf`` extra).
"""

from __future__ import annotations

import threading
from typing import Any

_LOAD_LOCK = threading.Lock()


def load_causal_lm(folder: str, **kwargs: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, **kwargs)``, serialised.

    Safe to call from several threads at once (``trio.to_thread.run_sync`` workers included):
    each caller gets a fully loaded model of its own.
    """
    from transformers import AutoModelForCausalLM

    with _LOAD_LOCK:
        return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, **kwargs)
