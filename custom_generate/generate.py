"""Hub-style entry point: ``model.generate(..., custom_generate="<this repo>", trust_remote_code=True)``.

transformers hands this function every ``generate`` argument (``assistant_model`` and ``streamer`` included)
and skips its own preparation; hf_specdec routes the call exactly as after ``hf_specdec.enable(model)``:
``assistant_model=`` -> adaptive speculative decoding, ``decoding="lookahead"`` -> lookahead decoding,
neither -> transformers' own generate.
"""

import functools

from transformers import GenerationMixin

from hf_specdec.integration import route_generate


def generate(model, *args, **kwargs):
    kwargs = {key: value for key, value in kwargs.items() if value is not None}
    return route_generate(functools.partial(GenerationMixin.generate, model), *args, model=model, **kwargs)
