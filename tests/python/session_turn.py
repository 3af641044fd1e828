"""Sends one chat turn through kv-router's gateway with the official `openai` client,
naming its conversation with OpenAI's `prompt_cache_key` (and, if given, also the
`x-session-id` header), and prints what it got as JSON.

Usage: session_turn.py BASE_URL MODEL PROMPT_CACHE_KEY TEXT [X_SESSION_ID]
"""

import json
import sys

import openai

base_url, model, key, text = sys.argv[1:5]
header = sys.argv[5] if len(sys.argv) > 5 else None
client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
chat = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": text}],
    max_tokens=2,
    prompt_cache_key=key,
    extra_headers={"x-session-id": header} if header else None,
)
print(json.dumps({"content": chat.choices[0].message.content}))
