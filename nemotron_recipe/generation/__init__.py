"""Text generation from the native model with cached Mamba and attention state.

The public API (stable; other parts of the project call it):

    from nemotron_recipe.generation import GenerationConfig, generate

    results = generate(model, [[1, 5, 9], [1, 7]], GenerationConfig(max_new_tokens=32), tokenizer=tok,
                       stream=lambda i, delta: print(delta, end=""))
    results[0].completion_ids, results[0].finish_reason, results[0].text

`generate` (generate.py) documents the behaviour; `GenerationConfig` (sampling.py) the settings;
`load_for_generation` (loading.py) builds a model and tokenizer from a training checkpoint, a
Hugging Face directory or a PEFT adapter directory.
"""

from nemotron_recipe.models.nemotron_v3.cache import DecodeCache, cache_bytes

from .generate import GenerationResult, StreamCallback, generate
from .sampling import GenerationConfig, GenerationError

__all__ = [
    "DecodeCache",
    "GenerationConfig",
    "GenerationError",
    "GenerationResult",
    "StreamCallback",
    "cache_bytes",
    "generate",
]
