"""The op table as Markdown, for docs/design.md."""

from __future__ import annotations

from .protocol import OPS, LeaseRole, Op, Service


_HANDLER = {
    Service.BROKER: "handlers.op_{}",
    Service.RINGS: "RingService.op_{}",
    Service.DAEMON: "Connection.op_{}",
}


def markdown_table() -> str:
    """The op table as Markdown: the one in ``docs/design.md`` is this (regenerate it with
    ``python -c "from kvbroker._wire.protocol_doc import markdown_table as t; print(t(), end='')"``;
    ``tests/test_op_table.py`` keeps the two equal)."""

    def args(op: Op) -> str:
        return ", ".join(f"`{n}`" if a.required else f"{n}" for n, a in op.args.items()) or "—"

    def lease(op: Op) -> str:
        roles = [r.name.lower() for r in (LeaseRole.TAKES, LeaseRole.NAMES) if r in op.lease]
        return " + ".join(roles) or "—"

    def draining(op: Op) -> str:
        if op.draining.refuse:
            return "refused"
        served = "served"
        if op.draining.args:
            served += " with " + ", ".join(f"{k}={v!r}" for k, v in op.draining.args)
        return served + (" if the pools are kept, else refused" if op.draining.publishes else "")

    def replica(op: Op) -> str:
        if op.replica is None:
            return "—"
        if not op.replica.routed:
            return "its own"
        return "answers" + "".join(f", {k}={v!r}" for k, v in op.replica.when)

    rows = [
        "| op | args (`required`) | reply | handler | lease | while draining | replica |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, op in OPS.items():
        reply = getattr(op.reply, "__name__", None) or str(op.reply).rpartition(".")[2]
        reply = reply.replace(" | ", " or ")  # a bar would end the Markdown cell
        rows.append(
            f"| `{name}` | {args(op)} | `{reply}` | `{_HANDLER[op.service].format(name)}`"
            f" | {lease(op)} | {draining(op)} | {replica(op)} |"
        )
    return "\n".join(rows) + "\n"
