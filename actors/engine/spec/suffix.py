"""A suffix index over groups of sibling sequences ("suffix" speculation).

Siblings are the samples of one `n` group and requests whose prompts share their first
`GROUP_HEAD` tokens (an RL group sent as separate requests, fork branches of one conversation):
their answers repeat each other, so each one's tokens are a draft source for the others. A
finished sibling stays a source while its group runs, up to `MAX_FINISHED` per group (the
oldest go first; the index is rebuilt once that many went, so the work stays amortised O(1)).
The index maps every n-gram (n <= `max_depth`) of every sibling to where it ended; a draft
follows the longest suffix of the drafting sequence that occurs anywhere in the group,
extending it token by token with the continuation seen most often, while that continuation's
share stays above `min_probability`. Plain Python: the engine updates it as tokens arrive.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence as Tokens

GROUP_HEAD = 256  # requests whose prompts share this many leading tokens are siblings
MAX_OCCURRENCES = 64  # newest occurrences kept per n-gram (bounds the work per draft)
MAX_FINISHED = 8  # finished members kept as sources per group


class _Group:
    def __init__(self) -> None:
        self.tokens: dict[int, Tokens[int]] = {}  # member id -> its (growing) token list
        self.indexed: dict[int, int] = {}  # member id -> tokens already in the index
        self.index: defaultdict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)
        self.running: set[int] = set()  # members not finished yet
        self.finished: list[int] = []  # finished members still sources, oldest first
        self.num_evicted = 0  # members dropped since the index was built

    def evict_oldest(self) -> None:
        member = self.finished.pop(0)
        del self.tokens[member], self.indexed[member]
        self.num_evicted += 1
        if self.num_evicted >= MAX_FINISHED:  # rebuild without the evicted members
            self.index.clear()
            self.indexed = dict.fromkeys(self.indexed, 0)
            self.num_evicted = 0


class SuffixIndex:
    def __init__(self, max_depth: int = 8, min_probability: float = 0.1):
        self.max_depth = max_depth
        self.min_probability = min_probability
        self._groups: dict[tuple[int, ...], _Group] = {}
        self._group_of: dict[int, tuple[int, ...]] = {}

    def add(self, member: int, tokens: Tokens[int], num_prompt_tokens: int) -> None:
        """Track a sequence; `tokens` is its live token list (read again on every draft)."""
        key = tuple(tokens[: min(GROUP_HEAD, num_prompt_tokens)])
        group = self._groups.setdefault(key, _Group())
        group.tokens[member], group.indexed[member] = tokens, 0
        group.running.add(member)
        self._group_of[member] = key

    def remove(self, member: int) -> None:
        """The sequence finished: it stays a draft source for its siblings still running, and
        its group is dropped with its last running member."""
        key = self._group_of.pop(member, None)
        if key is None:
            return
        group = self._groups[key]
        group.running.discard(member)
        if not group.running:
            del self._groups[key]
            return
        group.finished.append(member)
        if len(group.finished) > MAX_FINISHED:
            group.evict_oldest()

    def __contains__(self, member: int) -> bool:
        return member in self._group_of

    def propose(self, member: int, k: int) -> list[int]:
        """Up to k draft tokens for the member's next positions."""
        return self.propose_matched(member, k)[0]

    def propose_matched(self, member: int, k: int) -> tuple[list[int], int]:
        """(drafts, the length of the suffix match they follow)."""
        group = self._groups[self._group_of[member]]
        self._catch_up(group)
        tokens = group.tokens[member]
        length = len(tokens)
        for n in range(min(self.max_depth, length), 0, -1):
            grams = group.index.get(tuple(tokens[length - n :]), ())
            # not the tail itself; not a member evicted since the index was built
            occ = [o for o in grams if o != (member, length) and o[0] in group.tokens]
            if occ:
                return self._follow(group, occ, k), n
        return [], 0

    def _follow(self, group: _Group, occ: list[tuple[int, int]], k: int) -> list[int]:
        drafts: list[int] = []
        while occ and len(drafts) < k:
            nexts = Counter(group.tokens[m][end] for m, end in occ if end < len(group.tokens[m]))
            if not nexts:
                break
            token, count = nexts.most_common(1)[0]
            if count < self.min_probability * len(occ):
                break
            drafts.append(token)
            occ = [
                (m, end + 1)
                for m, end in occ
                if end < len(group.tokens[m]) and group.tokens[m][end] == token
            ]
        return drafts

    def _catch_up(self, group: _Group) -> None:
        """Index the n-grams ending at every member's tokens not indexed yet."""
        for member, tokens in group.tokens.items():
            start, length = group.indexed[member], len(tokens)
            for end in range(start + 1, length + 1):
                for n in range(1, min(self.max_depth, end) + 1):
                    occ = group.index[tuple(tokens[end - n : end])]
                    occ.append((member, end))
                    if len(occ) > MAX_OCCURRENCES:
                        del occ[0]
            group.indexed[member] = length
