"""A minimal P/D proxy for two ``vllm serve`` instances sharing a kvbroker daemon.

Each completion request goes first to the prefill server with ``max_tokens=1`` (it computes
the prompt and its connector saves the KV into the broker), then, unchanged, to the decode
server, whose connector finds the prompt's blocks by their token ids and loads them; the
decode server's answer (streamed or not) is returned. No KV transfer parameters travel
between the servers. Standard library + aiohttp (which vLLM installs).

    python examples/vllm/proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import copy

from aiohttp import ClientSession, ClientTimeout, web


def make_app(prefill: str, decode: str) -> web.Application:
    timeout = ClientTimeout(total=None)

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        first = copy.deepcopy(body)
        first.update(max_tokens=1, stream=False)
        first.pop("max_completion_tokens", None)
        first.pop("stream_options", None)
        async with ClientSession(timeout=timeout) as s:
            async with s.post(prefill + request.path, json=first) as r:
                if r.status != 200:  # the prefill failed: let decode compute it all
                    await r.read()
            async with s.post(decode + request.path, json=body) as r:
                out = web.StreamResponse(
                    status=r.status,
                    headers={"Content-Type": r.headers.get("Content-Type", "application/json")},
                )
                await out.prepare(request)
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out

    app = web.Application()
    app.router.add_post("/v1/completions", forward)
    app.router.add_post("/v1/chat/completions", forward)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", default="http://127.0.0.1:8100")
    ap.add_argument("--decode", default="http://127.0.0.1:8200")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    a = ap.parse_args()
    web.run_app(make_app(a.prefill.rstrip("/"), a.decode.rstrip("/")), host=a.host, port=a.port)


if __name__ == "__main__":
    main()
