"""Drives kv-router's gateway with the official `openai` client through the requests
that exercise its cache-parity monitor on a healthy fleet: repeated prompts,
prompts sharing a prefix, a block-aligned prompt, chats sharing a system prompt,
streamed (with and without the usage chunk) and whole. Prints one JSON object: the
cached prompt tokens each answer that carried usage reported, and whether any
stream that did not ask for usage got it anyway.

Usage: parity_client.py BASE_URL MODEL BLOCK_SIZE
"""

import json
import sys

import openai

base_url, model, block = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
cached = []
usage_unasked = 0
requests = 0


def cached_of(usage):
    details = usage.prompt_tokens_details if usage else None
    return details.cached_tokens if details else None


def complete(prompt, **kw):
    global requests
    requests += 1
    done = client.completions.create(model=model, prompt=prompt, max_tokens=4, **kw)
    cached.append(cached_of(done.usage))


def stream(prompt, usage):
    global usage_unasked, requests
    requests += 1
    options = {"include_usage": True} if usage else None
    chunks = list(
        client.completions.create(
            model=model, prompt=prompt, max_tokens=4, stream=True, stream_options=options
        )
    )
    with_usage = [c.usage for c in chunks if c.usage]
    if usage:
        cached.append(cached_of(with_usage[-1]))
    elif with_usage:
        usage_unasked += 1


document = " ".join(f"word{i % 37} part{i % 11}" for i in range(150))
# A document, repeated whole and streamed.
complete(document)
complete(document)
stream(document, usage=False)
stream(document, usage=True)
# Prompts sharing the document as a prefix, each with its own question.
for question in ["What is it about?", "Summarise it.", "Who wrote it?"]:
    complete(document + " " + question)
# A block-aligned token prompt, twice (the engine computes its last token again).
aligned = [1000 + i for i in range(8 * block)]
complete(aligned)
complete(aligned)
stream(aligned, usage=True)
# Chats sharing a system prompt.
system = {"role": "system", "content": document}
for user in ["Hi.", "Hello.", "Hi."]:
    requests += 1
    chat = client.chat.completions.create(
        model=model, messages=[system, {"role": "user", "content": user}], max_tokens=4
    )
    cached.append(cached_of(chat.usage))

print(json.dumps({"cached": cached, "usage_unasked": usage_unasked, "requests": requests}))
