"""Drives kv-router's gateway with the official `openai` client, as an application
would, and prints one JSON object of what it saw (the Rust test asserts on it).

Usage: gateway_client.py BASE_URL MODEL
"""

import json
import sys

import openai

base_url, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
seen = {}

seen["models"] = [m.id for m in client.models.list().data]

# A long shared prompt: many full blocks, so a repeat is a real prefix hit.
long_prompt = " ".join(f"word{i % 50}" for i in range(400))

done = client.completions.create(model=model, prompt=long_prompt, max_tokens=5)
seen["completion"] = {
    "text": done.choices[0].text,
    "finish_reason": done.choices[0].finish_reason,
    "prompt_tokens": done.usage.prompt_tokens,
    "completion_tokens": done.usage.completion_tokens,
}

chunks = list(
    client.completions.create(
        model=model,
        prompt=long_prompt,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
)
usage = chunks[-1].usage
seen["completion_stream"] = {
    "chunks": len(chunks),
    "text": "".join(c.choices[0].text for c in chunks if c.choices),
    "completion_tokens": usage.completion_tokens if usage else None,
    "cached_tokens": (
        usage.prompt_tokens_details.cached_tokens
        if usage and usage.prompt_tokens_details
        else None
    ),
    "prompt_tokens": usage.prompt_tokens if usage else None,
}

messages = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi."},
]
chat = client.chat.completions.create(model=model, messages=messages, max_tokens=4)
seen["chat"] = {
    "object": chat.object,
    "role": chat.choices[0].message.role,
    "content": chat.choices[0].message.content,
    "completion_tokens": chat.usage.completion_tokens,
}

deltas = list(
    client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, stream=True
    )
)
seen["chat_stream"] = {
    "chunks": len(deltas),
    "first_role": deltas[0].choices[0].delta.role,
    "content": "".join(d.choices[0].delta.content or "" for d in deltas if d.choices),
    "last_finish_reason": deltas[-1].choices[0].finish_reason,
}

try:
    client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    seen["unknown_model"] = "accepted"
except openai.NotFoundError as e:
    seen["unknown_model"] = e.status_code

try:
    client.completions.create(model=model, prompt=long_prompt * 20, max_tokens=1)
    seen["oversized"] = "accepted"
except openai.BadRequestError as e:
    seen["oversized"] = {"status": e.status_code, "message": str(e)}

print(json.dumps(seen))
