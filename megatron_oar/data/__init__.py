"""Data: dataset readers, prompt templates, the synthetic tasks (arithmetic expressions; the chain
task, the OAR testbed), the prompt sampler.

    from megatron_oar.data import PromptSampler, make_arithmetic, read_examples, render_prompt

    examples, stats = read_examples("dapo-math-17k.parquet", fields="dapo", tokenizer=tok,
                                    max_prompt_tokens=1024, template="answer_tag")
    sampler = PromptSampler(examples, batch_size=64, seed=1)
    texts = [render_prompt(ex.prompt, "answer_tag", tok) for ex in next(sampler)]
"""

from megatron_oar.data.chain import ChainConfig, ChainStream, chain_examples, chain_solution
from megatron_oar.data.readers import (
                                       ANSWER_FORMATS,
                                       PRESETS,
                                       DataError,
                                       Example,
                                       FieldMap,
                                       ReadStats,
                                       detect_preset,
                                       read_examples,
                                       write_jsonl,
)
from megatron_oar.data.sampler import PromptSampler
from megatron_oar.data.synthetic import ArithmeticConfig, arithmetic_problem, make_arithmetic
from megatron_oar.data.templates import TEMPLATES, PromptTemplate, build_messages, get_template, render_prompt

__all__ = [
    "ANSWER_FORMATS", "PRESETS", "TEMPLATES", "ArithmeticConfig", "ChainConfig", "ChainStream",
    "DataError", "Example", "FieldMap", "chain_examples", "chain_solution",
    "PromptSampler", "PromptTemplate", "ReadStats", "arithmetic_problem", "build_messages",
    "detect_preset", "get_template", "make_arithmetic", "read_examples", "render_prompt",
    "write_jsonl",
]
