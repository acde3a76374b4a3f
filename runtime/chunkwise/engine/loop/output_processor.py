"""The output side of a step: incremental detokenization, stop strings, and the RequestOutputs streamed to
callers. It owns each request's emission state and nothing of the scheduler's: a stop string it finds is
returned to whoever runs it, who releases the request."""

from __future__ import annotations

import time
from dataclasses import dataclass

from chunkwise.engine.datatypes.outputs import CompletionOutput, RequestOutput, TokenLogprob
from chunkwise.engine.datatypes.request import Request, RequestStatus
from chunkwise.engine.loop.step import Logprobs, StepUpdate
from chunkwise.engine.tokenizer import Tokenizer, make_detokenizer


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput]
    # Requests whose output ended in this batch (by the step or by a stop string).
    finished: list[Request]
    # Requests whose text reached a stop string: their output ended here, and the caller releases them
    # from the scheduler (at once in the step loop's thread; through the inbox from AsyncEngine's output
    # thread). The output processor never calls into the scheduler itself. Not those whose step also ended
    # them (the stop string completed by their last token): the scheduler has already released those.
    stopped: list[tuple[Request, str]]


class _OutputState:
    """Per-request emission state: incremental detokenization and stop strings."""

    # Text kept behind what was sent, for stop strings straddling steps, is trimmed past this many characters.
    TRIM_TEXT_AT = 4096

    def __init__(self, req: Request, prompt: str | None, tokenizer: Tokenizer) -> None:
        self.req = req
        self.prompt = prompt
        self.num_prompt_tokens = req.num_prompt_tokens
        params = req.sampling_params
        self.detok = make_detokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.stops = tuple(params.stop)
        self.max_stop = max((len(s) for s in self.stops), default=0)
        # Hold back this many characters while running: they could be the start of a stop string.
        self.holdback = max(self.max_stop - 1, 0)
        # Only with stop strings: the text not yet sent plus enough before it to find a straddling match.
        self.text = ""
        self.sent_chars = 0
        self.sent_tokens = 0
        # The prompt's log-probs, from the step that scored the prompt until the first output carries them.
        self.prompt_logprobs: list[TokenLogprob] | None = None


class _Group:
    """A request with n > 1 completions (sched/fork.py): its children's emission states, by child id, and
    which of its n choices have ended. The outside sees one request: the parent's id."""

    def __init__(self, parent: Request, prompt: str | None) -> None:
        self.parent = parent
        self.prompt = prompt
        self.n = parent.sampling_params.n
        self.children: dict[str, _OutputState] = {}
        self.done: set[int] = set()  # indices whose output has ended
        # The prompt's log-probs (the parent scores the prompt before the fork), until an output carries them.
        self.prompt_logprobs: list[TokenLogprob] | None = None

    def output(self) -> RequestOutput:
        """This step's output of the request, to which each choice that progressed adds its delta."""
        p = self.parent
        prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        return RequestOutput(
            request_id=p.request_id,
            prompt=self.prompt,
            prompt_token_ids=p.prompt_token_ids,
            outputs=[],
            finished=False,
            num_cached_tokens=p.num_cached_tokens,
            arrival_time=p.arrival_time,
            prompt_logprobs=prompt_logprobs,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _OutputState] = {}
        # Requests with n > 1, by the parent's id: their children's outputs are merged into one per step.
        self.groups: dict[str, _Group] = {}

    def add(self, req: Request, prompt: str | None) -> None:
        if req.sampling_params.n > 1:
            self.groups[req.request_id] = _Group(req, prompt)
        else:
            self.states[req.request_id] = _OutputState(req, prompt, self.tokenizer)

    def process(self, update: StepUpdate) -> ProcessedOutputs:
        """Detokenize each request's new tokens and look for stop strings; a match ends the request's
        output here and is reported in `stopped` for the caller to release."""
        outs: list[RequestOutput] = []
        finished_reqs: list[Request] = []
        stopped: list[tuple[Request, str]] = []
        states = self.states
        logprobs = update.logprobs
        if update.prompt_logprobs:
            for rid, scores in update.prompt_logprobs.items():
                if (pending := states.get(rid)) is not None:
                    pending.prompt_logprobs = scores
                elif (group := self.groups.get(rid)) is not None:  # n > 1: the parent scored the prompt
                    group.prompt_logprobs = scores
        children: list[tuple[Request, int, bool]] | None = None
        for req, num_tokens, finished in zip(update.reqs, update.num_tokens, update.finished):
            st = states.get(req.request_id)
            if st is None:
                if req.parent_id is not None:  # a choice of an n > 1 request: merged below
                    if children is None:
                        children = []
                    children.append((req, num_tokens, finished))
                elif finished and (group := self.groups.get(req.request_id)) is not None:
                    # An n > 1 request that ended before it forked (the scheduler's watchdog).
                    outs.append(self._ended_unforked(group, finished_reqs))
                continue  # else already finished here (a stop string), the step loop not yet told
            new_tokens, delta, stop = self._text(st, req, num_tokens, finished)
            if stop is not None:
                finished = self._stopped(req, finished, stop, stopped)
            lp = logprobs.get(req.request_id) if logprobs is not None else None
            outs.append(self._emit(st, req, finished, stop, new_tokens, delta, lp))
            if finished:
                finished_reqs.append(req)
        if children is not None:
            self._process_children(children, logprobs, outs, finished_reqs, stopped)
        return ProcessedOutputs(outs, finished_reqs, stopped)

    def _process_children(
        self,
        children: list[tuple[Request, int, bool]],
        logprobs: dict[str, Logprobs] | None,
        outs: list[RequestOutput],
        finished_reqs: list[Request],
        stopped: list[tuple[Request, str]],
    ) -> None:
        """process() for the choices of n > 1 requests: each choice's delta as in process(), its index its
        own; one RequestOutput per request per step, finished once all n choices have ended."""
        merged: dict[str, RequestOutput] = {}
        for req, num_tokens, finished in children:
            pid = req.parent_id
            assert pid is not None
            group = self.groups.get(pid)
            if group is None or req.index in group.done:
                continue  # its output already ended (a stop string, an abort)
            st = group.children.get(req.request_id)
            if st is None:
                st = group.children[req.request_id] = _OutputState(req, group.prompt, self.tokenizer)
            new_tokens, delta, stop = self._text(st, req, num_tokens, finished)
            if stop is not None:
                finished = self._stopped(req, finished, stop, stopped)
            lp = logprobs.get(req.request_id) if logprobs is not None else None
            choice = self._emit(st, req, finished, stop, new_tokens, delta, lp)
            out = merged.get(pid)
            if out is None:
                out = merged[pid] = group.output()
            completion = choice.outputs[0]
            completion.index = req.index
            out.outputs.append(completion)
            if out.first_token_time is None or (
                choice.first_token_time is not None and choice.first_token_time < out.first_token_time
            ):
                out.first_token_time = choice.first_token_time
            if finished:
                del group.children[req.request_id]
                self._choice_ended(group, out, req.index, completion, choice.finished_time, finished_reqs)
        for out in merged.values():
            out.outputs.sort(key=lambda c: c.index)
            outs.append(out)

    def _choice_ended(
        self,
        group: _Group,
        out: RequestOutput,
        index: int,
        completion: CompletionOutput,
        finished_time: float | None,
        finished_reqs: list[Request],
    ) -> None:
        group.done.add(index)
        if len(group.done) < group.n:
            return
        # The request's output ends with its last choice. The parent left the scheduler when it forked: the
        # output side is now its only writer, and records the request's end on it (metrics read it).
        parent = group.parent
        self.groups.pop(parent.request_id, None)
        out.finished = True
        out.finished_time = finished_time
        if parent.finish_reason is None:
            parent.finish_reason = completion.finish_reason
            parent.stop_reason = completion.stop_reason
            parent.finished_time = finished_time
        finished_reqs.append(parent)

    def _ended_unforked(self, group: _Group, finished_reqs: list[Request]) -> RequestOutput:
        """The last output of an n > 1 request whose parent finished before it forked: every choice ends
        with the parent's reason."""
        parent = group.parent
        out = group.output()
        for i in range(group.n):
            completion = CompletionOutput(
                index=i,
                text="",
                token_ids=[],
                finish_reason=parent.finish_reason,
                stop_reason=parent.stop_reason,
            )
            out.outputs.append(completion)
            self._choice_ended(group, out, i, completion, parent.finished_time, finished_reqs)
        return out

    @staticmethod
    def _stopped(req: Request, finished: bool, stop: str, stopped: list[tuple[Request, str]]) -> bool:
        """A stop string ended req's output: the caller releases it, unless this step already ended it (the
        scheduler has let it go; its output still ends at the stop string, finish_reason "stop")."""
        if not finished:
            stopped.append((req, stop))
        return True

    @classmethod
    def _text(
        cls, st: _OutputState, req: Request, num_tokens: int, finished: bool
    ) -> tuple[list[int], str, str | None]:
        """One sequence's new tokens of this step, the text that may be sent for them, and the stop string
        its text reached (None if none)."""
        new_tokens = req.token_ids[st.num_prompt_tokens + st.sent_tokens : num_tokens]
        step = st.detok.step
        piece = step(new_tokens[0]) if len(new_tokens) == 1 else "".join([step(t) for t in new_tokens])
        if finished:
            piece += st.detok.flush()
        if not st.stops:
            return new_tokens, piece, None
        delta, stop = cls._stop_strings(st, finished, piece)
        return new_tokens, delta, stop

    @staticmethod
    def _stop_strings(st: _OutputState, finished: bool, piece: str) -> tuple[str, str | None]:
        """Append `piece` and look for the first stop string: what may be sent, and the stop string that
        ended the output (None if none did)."""
        st.text += piece
        stop = None
        # The last piece too: the token that ends a request (its length, a stop token, the last of a
        # speculative step) may be the one that completes a stop string, which then ends the text there.
        # Only the tail can hold a new match: the new text plus a stop string's length before it.
        window_start = max(0, st.sent_chars - st.max_stop)
        best: tuple[int, str] | None = None
        for s in st.stops:
            idx = st.text.find(s, window_start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is not None:
            idx, stop = best
            keep = idx + len(stop) if st.req.sampling_params.include_stop_str_in_output else idx
            st.text = st.text[:keep]
            finished = True
        upto = len(st.text) if finished else max(st.sent_chars, len(st.text) - st.holdback)
        delta = st.text[st.sent_chars : upto]
        st.sent_chars = upto
        drop = st.sent_chars - st.max_stop
        if drop > st.TRIM_TEXT_AT:
            st.text = st.text[drop:]
            st.sent_chars -= drop
        return delta, stop

    def _emit(
        self,
        st: _OutputState,
        req: Request,
        finished: bool,
        stop: str | None,
        new_tokens: list[int],
        delta: str,
        logprobs: Logprobs | None,
    ) -> RequestOutput:
        st.sent_tokens += len(new_tokens)
        prompt_logprobs, st.prompt_logprobs = st.prompt_logprobs, None
        lp = None
        if logprobs is not None:
            lp = [TokenLogprob(t, v, top) for t, (v, top) in zip(new_tokens, logprobs)]
        finish_reason: str | None = None
        stop_reason: int | str | None = None
        finished_time: float | None = None
        if finished:
            self.states.pop(req.request_id, None)
            if stop is not None:
                finish_reason, stop_reason, finished_time = (
                    RequestStatus.FINISHED_STOPPED.value,
                    stop,
                    time.monotonic(),
                )
            else:
                finish_reason, stop_reason, finished_time = (
                    req.finish_reason,
                    req.stop_reason,
                    req.finished_time,
                )
        return RequestOutput(
            request_id=req.request_id,
            prompt=st.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=0,
                    text=delta,
                    token_ids=new_tokens,
                    finish_reason=finish_reason,
                    stop_reason=stop_reason,
                    logprobs=lp,
                )
            ],
            finished=finished,
            num_cached_tokens=req.num_cached_tokens,
            arrival_time=req.arrival_time,
            first_token_time=req.first_token_time,
            finished_time=finished_time,
            prompt_logprobs=prompt_logprobs,
        )

    def aborted_all(self, reqs: list[Request]) -> tuple[list[RequestOutput], list[Request]]:
        """The last outputs of requests the scheduler aborted (whose output had not already ended), and
        those requests, as the outside knows them. A request with n > 1 gets one output for what the abort
        ended of it: an aborted parent all n choices, aborted children theirs."""
        outs: list[RequestOutput] = []
        finished: list[Request] = []
        merged: dict[str, RequestOutput] = {}
        for req in reqs:
            if req.request_id in self.states:
                outs.append(self.aborted(req))
                finished.append(req)
                continue
            group = self.groups.get(req.parent_id if req.parent_id is not None else req.request_id)
            if group is None:
                continue
            out = merged.get(group.parent.request_id)
            if out is None:
                out = merged[group.parent.request_id] = group.output()
            t = req.first_token_time
            if t is not None and (out.first_token_time is None or t < out.first_token_time):
                out.first_token_time = t
            indices = [req.index] if req.parent_id is not None else range(group.n)
            for i in indices:
                if i in group.done:
                    continue
                group.children.pop(req.request_id, None)
                completion = CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort")
                out.outputs.append(completion)
                self._choice_ended(group, out, i, completion, req.finished_time, finished)
        for out in merged.values():
            if out.outputs:
                out.outputs.sort(key=lambda c: c.index)
                outs.append(out)
        return outs, finished

    def aborted(self, req: Request) -> RequestOutput:
        st = self.states.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id,
            prompt=st.prompt if st else None,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="abort")],
            finished=True,
            num_cached_tokens=req.num_cached_tokens,
            arrival_time=req.arrival_time,
            first_token_time=req.first_token_time,
            finished_time=req.finished_time,
        )
