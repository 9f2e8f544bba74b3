"""The "basic setup" peer: Hugging Face transformers `generate` behind a minimal OpenAI-compatible
streaming server that serves one request at a time, as a first deployment often does.

    python -m tokenmill.bench.hf_server --model smollm2-135m-instruct --port 8001

It speaks just what `tokenmill bench` sends: /v1/chat/completions and /v1/completions with
`stream`, `max_tokens`, `temperature` and `ignore_eos`, usage in the last chunk, and /health.
It is a measured peer, not part of the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from tokenmill.model.loader import load_tokenizer, resolve_model_path


class _TokenStream(BaseStreamer):
    """Hands each generated token id from the generate thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue, self.prompt_seen = loop, queue, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate passes the prompt first
            self.prompt_seen = True
            return
        for token_id in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, token_id)

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


class _Cancelled(StoppingCriteria):
    """Stops generate once the client has gone."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)


def build_app(model, tokenizer, model_name: str) -> FastAPI:
    app = FastAPI()
    one_at_a_time = asyncio.Lock()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    async def generate(body: dict, chat: bool):
        if chat:
            prompt_ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True,
                                                       tokenize=True, return_dict=False)
        elif isinstance(body["prompt"], list):
            prompt_ids = body["prompt"]
        else:
            prompt_ids = tokenizer.encode(body["prompt"])
        max_tokens = int(body.get("max_tokens") or 16)
        temperature = float(body.get("temperature", 1.0))
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 \
            else {"do_sample": False}
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()
        input_ids = torch.tensor([prompt_ids])
        kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                      max_new_tokens=max_tokens,
                      min_new_tokens=max_tokens if body.get("ignore_eos") else None,
                      streamer=_TokenStream(asyncio.get_running_loop(), queue),
                      stopping_criteria=StoppingCriteriaList([_Cancelled(cancelled)]),
                      **sampling)
        async with one_at_a_time:
            worker = asyncio.create_task(asyncio.to_thread(model.generate, **kwargs))
            try:
                token_ids: list[int] = []
                shown = ""
                while (token_id := await queue.get()) is not None:
                    token_ids.append(token_id)
                    text = tokenizer.decode(token_ids, skip_special_tokens=True)
                    if not text.endswith("\ufffd"):  # hold back half of a UTF-8 character
                        yield text[len(shown):], None
                        shown = text
                yield "", {"prompt_tokens": len(prompt_ids), "completion_tokens": len(token_ids),
                           "total_tokens": len(prompt_ids) + len(token_ids)}
            finally:
                cancelled.set()
                await worker

    def chunk(request_id: str, chat: bool, text: str, usage: dict | None) -> str:
        choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
        payload = {"id": request_id, "object": "chat.completion.chunk" if chat else
                   "text_completion", "created": int(time.time()), "model": model_name,
                   "choices": [] if usage else [choice]}
        if usage:
            payload["usage"] = usage
        return f"data: {json.dumps(payload)}\n\n"

    async def respond(request: Request, chat: bool):
        body = await request.json()
        request_id = f"hf-{uuid.uuid4().hex}"
        if body.get("stream"):
            async def events():
                async for text, usage in generate(body, chat):
                    if text or usage:
                        yield chunk(request_id, chat, text, usage)
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        pieces, usage = [], None
        async for text, usage in generate(body, chat):
            pieces.append(text)
        text = "".join(pieces)
        choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat \
            else {"index": 0, "text": text}
        return JSONResponse({"id": request_id, "model": model_name, "choices": [choice],
                             "usage": usage})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await respond(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await respond(request, chat=False)

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="built-in model name, .gguf file or safetensors folder")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--served-model-name", default="hf-generate")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    gguf = {"gguf_file": path.name} if path.is_file() else {}
    model = AutoModelForCausalLM.from_pretrained(path.parent if gguf else path, **gguf,
                                                 dtype=getattr(torch, args.dtype)).eval()
    # tokenmill's tokenizer of the same file: it carries the GGUF's chat template.
    tokenizer = load_tokenizer(args.model)
    uvicorn.run(build_app(model, tokenizer, args.served_model_name), host="127.0.0.1",
                port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
