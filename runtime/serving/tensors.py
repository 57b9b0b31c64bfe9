"""The served model's tensors, named as TensorRT-LLM's Triton models name them: the one table that
config.pbtxt (compiler/repository/triton_config.py), the request parser (request.py) and the client
(llmc/client.py) all read. Plain data importing nothing, so the client loads it without the
runtime's dependencies (pydantic, tokenizers, ONNX Runtime).

Required input `text_input` (BYTES [1]); optional `stop_words` (BYTES [-1]), the texts and the scalars
below.
"""

from __future__ import annotations

# The served model's optional scalar inputs: name -> (Triton datatype, SamplingParams field or None).
SCALARS: dict[str, tuple[str, str | None]] = {
    "max_tokens": ("INT32", "max_tokens"), "min_tokens": ("INT32", "min_tokens"), "top_k": ("INT32", "top_k"),
    "end_id": ("INT32", None), "pad_id": ("INT32", None), "seed": ("UINT64", "seed"),
    "temperature": ("FP32", "temperature"), "top_p": ("FP32", "top_p"), "min_p": ("FP32", "min_p"),
    "repetition_penalty": ("FP32", "repetition_penalty"), "frequency_penalty": ("FP32", "frequency_penalty"),
    "presence_penalty": ("FP32", "presence_penalty"),
    "stream": ("BOOL", None), "exclude_input_in_output": ("BOOL", None), "return_log_probs": ("BOOL", None),
    "return_num_input_tokens": ("BOOL", None), "return_num_output_tokens": ("BOOL", None),
    "stop": ("BOOL", None),  # a stop request: end the request sent under the same request id (is_stop)
    "num_top_logprobs": ("INT32", None),  # with return_log_probs: the N most likely tokens per step (logprobs.py)
    # false: the prompt is encoded without the tokenizer's BOS/EOS, as transformers encodes a rendered chat
    # template (it writes its own); the OpenAI frontend and `llmc generate --chat` send it (decoding/tokenizer.py)
    "add_special_tokens": ("BOOL", None),
    # beam search (runtime/engine/beam.py), TensorRT-LLM's names and types: 1 = off, at most serving.max_beam_width
    "beam_width": ("INT32", "beam_width"), "length_penalty": ("FP32", "length_penalty"),
    "early_stopping": ("BOOL", "early_stopping"),
    "lora_task_id": ("UINT64", None),  # TensorRT-LLM's: a loaded adapter by its task id (beside LORA_NAME below)
}
# The served model's optional text inputs (BYTES [1]). Structured output (runtime/decoding/grammar.py), as
# TensorRT-LLM's backend names it: the guide's type (json, json_schema, regex, ebnf_grammar, lark_grammar,
# choice) and the guide itself (a schema, regex, grammar or JSON list of choices; none for json).
GUIDE_TEXTS: tuple[str, ...] = ("guided_decoding_guide_type", "guided_decoding_guide")
# The LoRA adapter a request runs under, by name, as Triton's vLLM backend names it (docs/lora.md); unset: the base.
LORA_NAME = "lora_name"
# Adapters loaded and unloaded while the model serves (runtime/serving/lora_admin.py): a control request carries
# `lora_control` (JSON: {"op": "load" | "unload" | "list", ...}) and, to load, `lora_adapter` (an adapter file's
# bytes, runtime/lora/files.py); it is answered with one JSON `text_output`. TensorRT-LLM's `lora_task_id` (UINT64,
# in SCALARS) names an adapter loaded with one.
LORA_CONTROL, LORA_ADAPTER, LORA_TASK_ID = "lora_control", "lora_adapter", "lora_task_id"
TEXTS: tuple[str, ...] = (*GUIDE_TEXTS, LORA_NAME, LORA_CONTROL, LORA_ADAPTER)
# config.pbtxt's parameter listing the adapters a request may name, as a JSON list (the OpenAI frontend reads it)
ADAPTERS_PARAMETER = "lora_adapters"
# outputs: name -> (Triton datatype, dims). A beam request (beam_width W > 1) gets TensorRT-LLM's
# shapes in its one final response: text_output [W], output_ids [W, longest] (padded with the end id),
# sequence_length [W], cum_log_probs [W]; output_ids is declared [-1] for the plain requests' [len]
# (Triton does not check a Python model's response shapes against config.pbtxt).
OUTPUTS: dict[str, tuple[str, list[int]]] = {
    "text_output": ("BYTES", [-1]), "output_ids": ("INT32", [-1]), "finish_reason": ("BYTES", [1]),
    "num_input_tokens": ("INT32", [1]), "num_output_tokens": ("INT32", [1]),
    # with return_log_probs (runtime/decoding/logprobs.py): per generated token, and the top-N alternatives
    "output_log_probs": ("FP32", [-1]), "cum_log_probs": ("FP32", [-1]), "token_texts": ("BYTES", [-1]),
    "top_log_prob_ids": ("INT32", [-1, -1]), "top_log_probs": ("FP32", [-1, -1]), "top_token_texts": ("BYTES", [-1, -1]),
    "sequence_length": ("INT32", [-1]),  # a beam request's: each beam's generated tokens
}
