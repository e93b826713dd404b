"""weft: a text-generation engine for causal language models.

from weft import LLM, SamplingParams
llm = LLM()  # the default model (SmolLM2-135M-Instruct); or LLM(model="path/to/checkpoint")
print(llm.generate("The capital of France is", SamplingParams(max_tokens=32))[0].outputs[0].text)
"""

from weft.fields import FieldLogprobs, Fields, field_logprobs
from weft.llm import LLM, bundled_model_path, default_model_path
from weft.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    ChoiceScore,
    CompletionOutput,
    Logprob,
    RequestOutput,
)
from weft.params import (
    BeamSearchParams,
    ChoiceSelection,
    LogprobsMode,
    OutputKind,
    SamplingParams,
    SMCParams,
)

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "ChoiceScore",
    "ChoiceSelection",
    "CompletionOutput",
    "FieldLogprobs",
    "Fields",
    "Logprob",
    "LogprobsMode",
    "OutputKind",
    "RequestOutput",
    "SMCParams",
    "SamplingParams",
    "bundled_model_path",
    "default_model_path",
    "field_logprobs",
]
__version__ = "0.1.0"
