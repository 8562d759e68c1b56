"""The prefix cache's index: a tree of fixed token blocks keyed by a hash chain of their contents,
plus "tail" leaves for prefixes that end inside a block (the end of a prompt or of a request).

Pure bookkeeping, no arrays: a node names the MLA pages (device page ids, or a host copy) holding
its tokens and optionally one KDA checkpoint taken exactly at its end. Running requests pin the
chain of nodes whose pages they read, so those are never evicted; nodes are listed in one LRU
order shared by both memory tiers.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def chain_key(parent_key: bytes, tokens) -> bytes:
    """Key of a block: a hash of its parent's key and its own tokens (so equal keys mean equal
    prefixes, not just equal blocks)."""
    return hashlib.blake2b(parent_key + np.asarray(tokens, np.int64).tobytes(), digest_size=16).digest()


class Node:
    __slots__ = ("key", "parent", "depth", "length", "pages", "host_pages", "ckpt", "host_ckpt", "pins",
                 "children", "tails")

    def __init__(self, key, parent, depth, length):
        self.key, self.parent, self.depth, self.length = key, parent, depth, length
        self.pages = None       # device page ids covering positions [depth - length, depth)
        self.host_pages = None  # or a host copy of them (HostTier item)
        self.ckpt = None        # KDA checkpoint at `depth` on device
        self.host_ckpt = None   # or on host
        self.pins = 0           # running requests reading this node's pages
        self.children: dict[bytes, Node] = {}  # next full blocks
        self.tails: dict[tuple, Node] = {}     # prefixes ending inside the next block

    @property
    def is_tail(self) -> bool:
        return self.parent is not None and self in self.parent.tails.values()

    @property
    def has_ckpt(self) -> bool:
        return self.ckpt is not None or self.host_ckpt is not None

    def __repr__(self):
        return f"Node(depth={self.depth}, pins={self.pins}, pages={self.pages})"


class PrefixIndex:
    def __init__(self, block: int):
        self.block = block
        self.root = Node(b"", None, 0, 0)
        self.root.pages = []
        self.lru: OrderedDict[int, Node] = OrderedDict()  # oldest first; root is never listed

    def nodes(self):
        return list(self.lru.values())

    def touch(self, node: Node):
        if node is not self.root:
            self.lru.move_to_end(id(node))

    def child(self, parent: Node, tokens) -> Node | None:
        return parent.children.get(chain_key(parent.key, tokens))

    def add_block(self, parent: Node, tokens, pages, key: bytes) -> Node:
        """A block node under `parent`; `key` is chain_key(parent.key, tokens), which the caller
        has computed to look the block up first."""
        assert key not in parent.children
        node = Node(key, parent, parent.depth + len(tokens), len(tokens))
        node.pages = list(pages)
        parent.children[key] = node
        self.lru[id(node)] = node
        return node

    def add_tail(self, parent: Node, tokens, pages) -> Node:
        tokens = tuple(int(t) for t in tokens)
        assert tokens not in parent.tails and 0 < len(tokens) < self.block
        node = Node(chain_key(parent.key, tokens), parent, parent.depth + len(tokens), len(tokens))
        node.pages = list(pages)
        parent.tails[tokens] = node
        self.lru[id(node)] = node
        return node

    def tail(self, parent: Node, tokens) -> Node | None:
        return parent.tails.get(tuple(int(t) for t in tokens))

    def match(self, tokens, limit: int):
        """The longest usable hit for `tokens`: (chain of block nodes from the root, tail node or
        None, hit length, deepest matched block depth). A hit needs a KDA checkpoint exactly at its
        end and at most `limit` tokens (at least one token must still be computed)."""
        path, node = [], self.root
        best = (0, 0, None)  # (hit length, blocks in path, tail)
        while True:
            for t, tail in node.tails.items():
                end = node.depth + len(t)
                if end <= limit and end > best[0] and tail.has_ckpt and tuple(tokens[node.depth:end]) == t:
                    best = (end, len(path), tail)
            if node.depth + self.block > len(tokens):
                break
            nxt = self.child(node, tokens[node.depth:node.depth + self.block])
            if nxt is None:
                break
            node = nxt
            path.append(node)
            if node.depth <= limit and node.has_ckpt and node.depth > best[0]:
                best = (node.depth, len(path), None)
        hit, n, tail = best
        return path[:n], tail, hit, node.depth

    def subtree(self, node: Node) -> list[Node]:
        out, todo = [], [node]
        while todo:
            n = todo.pop()
            out.append(n)
            todo += list(n.children.values()) + list(n.tails.values())
        return out

    def unlink(self, node: Node):
        """Remove one node (its descendants must be gone already)."""
        assert not node.children and not node.tails and node.pins == 0
        p = node.parent
        if node.is_tail:
            del p.tails[next(t for t, n in p.tails.items() if n is node)]
        else:
            del p.children[node.key]
        del self.lru[id(node)]
