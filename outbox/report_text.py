"""The wording of a run's report: one message table per language (``MESSAGES``), holding
every sentence ``outbox.report`` renders: the message key of each line
(``outbox.report_lines``), the headings, the reasons and the compensation notes. Pure data.
"""

from __future__ import annotations

from typing import Literal, get_args

from outbox.errors import InvalidInput

Lang = Literal["en", "zh"]
LANGS: tuple[str, ...] = get_args(Lang)

#: Every sentence of the report, per language. Placeholders: op, kind, ref, reason, code, of,
#: comp, delay (a duration), n; counts: done, not_done, uncertain; a stop's: tries, span, n
#: (tries that reached the service), cause, and a cause's status; an uncertain one's by (the
#: latest it is decided by, ``when.<waits_for>``: ``outbox.verdict_due.WaitsFor``).
MESSAGES: dict[str, dict[str, str]] = {
    "en": {
        "title": "Run {handle}: {done} done, {not_done} not done, {uncertain} uncertain.",
        "stopped": "Stopped further processing at the user's request.",
        "heading.done": "Done:",
        "heading.not_done": "Not done:",
        "heading.uncertain": "Uncertain:",
        "none": "  (none)",
        "kind_amount": "{kind} of {amount}",
        "done": "Operation {op} ({kind}) is done (receipt {ref}).",
        "done_no_receipt": (
            "Operation {op} ({kind}) is recorded as done, without a downstream receipt."
        ),
        "done_staff": (
            "Operation {op} ({kind}) is recorded as done by support staff (reference {ref}); "
            "this is their statement, not a receipt from the service."
        ),
        "done_differs": (
            "Operation {op} ({kind}) was done by the service (receipt {ref}), but with other "
            "details than were asked for; support staff have checked it."
        ),
        "rejected": "Operation {op} ({kind}) was not done: {reason}{code}.",
        "rejected_staff": (
            "Operation {op} ({kind}) is recorded as not done by support staff; "
            "this is their statement, not a record from the service."
        ),
        "cancelled": "Operation {op} ({kind}) was cancelled before it was sent.",
        "cancelled_after_check": (
            "Operation {op} ({kind}) was cancelled; its earlier attempts were checked and had "
            "no effect."
        ),
        "planned": "Operation {op} ({kind}) has not been sent yet.",
        "planned_again": (
            "Operation {op} ({kind}) has not been done yet; its earlier attempts had no effect "
            "and it will be tried again."
        ),
        "planned_stopped": "Operation {op} ({kind}) was stopped before it was sent.",
        "planned_stopped_again": (
            "Operation {op} ({kind}) was stopped; its earlier attempts had no effect."
        ),
        "pending": "The result of operation {op} ({kind}) is still pending confirmation.",
        "pending_review": (
            "The result of operation {op} ({kind}) is still pending confirmation; "
            "support staff are checking it."
        ),
        "pending_stopped": (
            "Stopped further processing, but the result of operation {op} ({kind}) "
            "is still pending confirmation."
        ),
        "pending_stopped_review": (
            "Stopped further processing, but the result of operation {op} ({kind}) "
            "is still pending confirmation; support staff are checking it."
        ),
        "compensation_prefix": "Compensation of {of}: ",
        "code": " ({code})",
        "comp.restored": " Restored by compensation {comp} (receipt {ref}).",
        "comp.staff": (
            " Support staff recorded compensation {comp} as done (reference {ref}); this is "
            "their statement, not a receipt from the service."
        ),
        "comp.pending": " Compensation {comp} is still pending confirmation.",
        "comp.not_sent": " Compensation {comp} has not been sent yet.",
        "comp.not_done": " Compensation {comp} was not done, so nothing has been reversed.",
        "reason.business_rejected": "refused by the service",
        "reason.invalid_params": "the request was invalid",
        "reason.permission_denied": "not permitted",
        "reason.not_executed": "it could not be sent in time",
        "reason.not_executed_sent": "it was not carried out in time",
        "reason.credentials_refused": (
            "the service refused our credentials (an API key missing or wrong), so nothing "
            "was carried out"
        ),
        "reason.fingerprint_mismatch": (
            "it was not sent, as its details did not match their fingerprint (the app's and "
            "the worker's fingerprint keys differ); support staff have been told"
        ),
        "reason.None": "refused",
        "rests_on.deadline_fence": (
            " This rests on the service refusing any request that arrives past its deadline."
        ),
        "rests_on.delay_bound": (
            " This assumes that no request reaches the service more than {delay} late."
        ),
        "duration.min": "{n} min",
        "duration.s": "{n} s",
        "duration.unknown": "the declared delay",
        "duration.h": "{n} h",
        "stop.deadline_passed": "gave up at its deadline after {tries}{span}{cause}",
        "stop.attempts_exhausted": (
            "gave up after {tries}{span}, all the attempts it was allowed ({n}) spent without "
            "effect{cause}"
        ),
        "stop.retry_after_past_deadline": (
            "gave up after {tries}{span}; the service asked to wait past its deadline"
        ),
        "stop.tries_exhausted": "gave up after {tries}{span}, the most tries allowed{cause}",
        "tries.one": "1 try",
        "tries.many": "{n} tries",
        "span.over": " over {d}",
        "span.short": " within a second",
        "span.unknown": "",
        "cause": " ({text})",
        "cause.refused": "the service refused connections",
        "cause.unreachable": "the service could not be reached",
        "cause.busy": "the service was busy, HTTP 429",
        "cause.not_processed": "the service declined to process it, HTTP {status}",
        "when.send": (
            " Waiting for the service's answer to the send; decided by {by} at the latest, "
            "or handed to support staff."
        ),
        "when.lookup": (
            " Asking the service again; decided by {by} at the latest, or handed to support staff."
        ),
        "when.quiescence": (
            ' Waiting until no late request can still reach the service, so that a "not '
            'found" can be trusted; decided by {by} at the latest, or handed to support staff.'
        ),
        "when.clock_step": (
            ' Waiting out a step of the database\'s clock before a "not found" is trusted; '
            "decided by {by} at the latest, or handed to support staff."
        ),
        "when.review": (
            " It cannot be settled automatically: it goes to support staff by {by} at the latest."
        ),
        "when.staff": " No time can be promised until they decide.",
    },
    "zh": {
        "title": "任务 {handle}：已完成 {done} 项，未完成 {not_done} 项，待确认 {uncertain} 项。",
        "stopped": "已按用户要求停止继续处理。",
        "heading.done": "已完成：",
        "heading.not_done": "未完成：",
        "heading.uncertain": "待确认：",
        "none": "  （无）",
        "kind_amount": "{kind}，{amount}",
        "done": "操作 {op}（{kind}）已完成（回执 {ref}）。",
        "done_no_receipt": "操作 {op}（{kind}）记录为已完成，但没有下游回执。",
        "done_staff": (
            "客服人员将操作 {op}（{kind}）记录为已完成（参考号 {ref}）；"
            "这是客服人员的陈述，不是对方服务的回执。"
        ),
        "rejected": "操作 {op}（{kind}）未完成：{reason}{code}。",
        "rejected_staff": (
            "客服人员将操作 {op}（{kind}）记录为未完成；这是客服人员的陈述，不是对方服务的记录。"
        ),
        "done_differs": (
            "对方服务已执行操作 {op}（{kind}）（回执 {ref}），但执行内容与请求不同；"
            "客服人员已核查。"
        ),
        "cancelled": "操作 {op}（{kind}）在发送前已取消。",
        "cancelled_after_check": "操作 {op}（{kind}）已取消；此前的尝试经核实未生效。",
        "planned": "操作 {op}（{kind}）尚未发送。",
        "planned_again": "操作 {op}（{kind}）尚未完成；此前的尝试未生效，将再次尝试。",
        "planned_stopped": "操作 {op}（{kind}）在发送前已停止。",
        "planned_stopped_again": "操作 {op}（{kind}）已停止；此前的尝试未生效。",
        "pending": "操作 {op}（{kind}）的结果仍待确认。",
        "pending_review": "操作 {op}（{kind}）的结果仍待确认，客服人员正在核查。",
        "pending_stopped": "已停止继续处理，但操作 {op}（{kind}）的结果仍待确认。",
        "pending_stopped_review": (
            "已停止继续处理，但操作 {op}（{kind}）的结果仍待确认，客服人员正在核查。"
        ),
        "compensation_prefix": "{of} 的补偿：",
        "code": "（{code}）",
        "comp.restored": "已由补偿操作 {comp} 撤销，已恢复（回执 {ref}）。",
        "comp.staff": (
            "客服人员将补偿操作 {comp} 记录为已完成（参考号 {ref}）；"
            "这是客服人员的陈述，不是对方服务的回执。"
        ),
        "comp.pending": "补偿操作 {comp} 的结果仍待确认。",
        "comp.not_sent": "补偿操作 {comp} 尚未发送。",
        "comp.not_done": "补偿操作 {comp} 未完成，原操作未被撤销。",
        "reason.business_rejected": "被对方服务拒绝",
        "reason.invalid_params": "请求无效",
        "reason.permission_denied": "没有权限",
        "reason.not_executed": "未能及时发送",
        "reason.not_executed_sent": "未能及时执行",
        "reason.credentials_refused": (
            "对方服务拒绝了我方凭据（API 密钥缺失或错误），未执行任何操作"
        ),
        "reason.fingerprint_mismatch": (
            "未发送，因其内容与指纹不符（应用与工作进程的指纹密钥不一致），已通知客服人员"
        ),
        "reason.None": "被拒绝",
        "rests_on.deadline_fence": "此结论的依据：对方服务拒绝超过截止时间才到达的请求。",
        "rests_on.delay_bound": "此结论的前提：任何请求到达对方服务的延迟都不超过 {delay}。",
        "duration.min": "{n} 分钟",
        "duration.s": "{n} 秒",
        "duration.unknown": "声明的延迟上限",
        "duration.h": "{n} 小时",
        "stop.deadline_passed": "已到截止时间，放弃重试：共尝试 {tries}{span}{cause}",
        "stop.attempts_exhausted": (
            "放弃重试：共尝试 {tries}{span}，允许的 {n} 次尝试均已用完且未生效{cause}"
        ),
        "stop.retry_after_past_deadline": (
            "放弃重试：共尝试 {tries}{span}；对方服务要求等待的时间超过了截止时间"
        ),
        "stop.tries_exhausted": "放弃重试：共尝试 {tries}{span}，已达尝试次数上限{cause}",
        "tries.one": "1 次",
        "tries.many": "{n} 次",
        "span.over": "，历时 {d}",
        "span.short": "，历时不到 1 秒",
        "span.unknown": "",
        "cause": "（{text}）",
        "cause.refused": "对方服务拒绝连接",
        "cause.unreachable": "无法连接对方服务",
        "cause.busy": "对方服务繁忙，HTTP 429",
        "cause.not_processed": "对方服务未处理该请求，HTTP {status}",
        "when.send": "正在等待对方服务对本次发送的答复；最迟于 {by} 得出结论，或转交客服人员处理。",
        "when.lookup": "正在再次向对方服务查询；最迟于 {by} 得出结论，或转交客服人员处理。",
        "when.quiescence": (
            "正在等待，直到不再有迟到的请求可能到达对方服务，“未找到”的查询结果才可采信；"
            "最迟于 {by} 得出结论，或转交客服人员处理。"
        ),
        "when.clock_step": (
            "数据库时钟发生了跳变，正在等待其影响过去后再采信“未找到”的查询结果；"
            "最迟于 {by} 得出结论，或转交客服人员处理。"
        ),
        "when.review": "无法自动确认：最迟于 {by} 转交客服人员处理。",
        "when.staff": "客服人员核查完成前，无法承诺具体时间。",
    },
}


def check_lang(lang: object) -> Lang:
    if lang == "en":
        return "en"
    if lang == "zh":
        return "zh"
    raise InvalidInput(f"lang must be one of {list(LANGS)}", code="unsupported_language")
