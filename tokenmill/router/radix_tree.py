"""RadixTree: an approximate record of the prompt text one worker has seen recently.

Character-level, as SGLang's router keeps it: the router never tokenizes, and text shared by two
prompts is a good proxy for KV blocks shared in the worker's prefix cache. It is approximate
because the worker evicts on its own schedule; this tree is bounded by `max_chars` and evicts its
least recently used leaves when an insert passes the bound.
"""

from __future__ import annotations

import heapq
import itertools


class _Node:
    __slots__ = ("edge", "children", "parent", "last_used")

    def __init__(self, edge: str, parent: _Node | None, last_used: int) -> None:
        self.edge = edge  # the text on the edge from the parent to this node
        self.children: dict[str, _Node] = {}  # keyed by the first character of their edge
        self.parent = parent
        self.last_used = last_used


def _common_prefix_length(a: str, b: str) -> int:
    length = min(len(a), len(b))
    if a[:length] == b[:length]:  # the usual case: one C-level comparison
        return length
    low, high = 0, length  # the first mismatch lies in [low, high)
    while high - low > 1:
        middle = (low + high) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle
    return low


class RadixTree:
    def __init__(self, max_chars: int) -> None:
        if max_chars < 1:
            raise ValueError(f"invalid router option max_tree_chars={max_chars}: must be >= 1")
        self.max_chars = max_chars
        self.num_chars = 0
        self._clock = itertools.count(1)
        self._root = _Node("", None, 0)

    def match(self, text: str) -> int:
        """Characters of the longest prefix of `text` in the tree; marks that path used."""
        node, matched = self._root, 0
        now = next(self._clock)
        while matched < len(text):
            child = node.children.get(text[matched])
            if child is None:
                break
            common = _common_prefix_length(child.edge, text[matched:matched + len(child.edge)])
            child.last_used = now
            matched += common
            if common < len(child.edge):
                break
            node = child
        return matched

    def insert(self, text: str) -> None:
        node, position = self._root, 0
        now = next(self._clock)
        while position < len(text):
            child = node.children.get(text[position])
            if child is None:
                node.children[text[position]] = _Node(text[position:], node, now)
                self.num_chars += len(text) - position
                break
            common = _common_prefix_length(child.edge, text[position:position + len(child.edge)])
            if common < len(child.edge):  # split the edge where the texts part
                middle = _Node(child.edge[:common], node, now)
                node.children[text[position]] = middle
                child.edge = child.edge[common:]
                child.parent = middle
                middle.children[child.edge[0]] = child
                child = middle
            child.last_used = now
            position += common
            node = child
        if self.num_chars > self.max_chars:
            self._evict()

    def clear(self) -> None:
        self._root.children.clear()
        self.num_chars = 0

    def _evict(self) -> None:
        """Drop least recently used leaves until the tree fits its bound."""
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children]
        heapq.heapify(leaves)
        while self.num_chars > self.max_chars and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[leaf.edge[0]]
            self.num_chars -= len(leaf.edge)
            if parent is not self._root and not parent.children:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))

    def _nodes(self) -> list[_Node]:
        nodes, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes
