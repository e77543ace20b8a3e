"""Solutions of the exercises in 06_serving.ipynb (see 01_paging.py for how they are used)."""


# %% exercise 6.1
def stream_text(client, model, messages, max_tokens):
    """The answer to `messages`, assembled from a streamed chat completion (greedy)."""
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                            temperature=0, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


# %% exercise 6.2
def parse_metrics(text):
    """Prometheus text format -> {"name{labels}": float value}."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples
