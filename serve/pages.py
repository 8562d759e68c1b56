"""Page allocator for the paged MLA latent cache: a free list plus an owner per page, so leaks
and double ownership are checkable after every step."""
from __future__ import annotations


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"need at least one cache page, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._owner: dict[int, object] = {}

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self, n: int, owner) -> list[int] | None:
        """n pages for `owner`, or None (nothing taken) if fewer than n are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._owner[p] = owner
        return pages

    def owner(self, page: int):
        return self._owner.get(page)

    def transfer(self, pages: list[int], owner, new_owner):
        """Hand pages from one owner to another (a request's finished blocks to the prefix cache)."""
        for p in pages:
            if self._owner.get(p) != owner:
                raise AssertionError(f"page {p} handed on by {owner!r} but owned by {self._owner.get(p)!r}")
            self._owner[p] = new_owner

    def release(self, pages: list[int], owner):
        for p in pages:
            if self._owner.get(p) != owner:
                raise AssertionError(f"page {p} released by {owner!r} but owned by {self._owner.get(p)!r}")
            del self._owner[p]
            self._free.append(p)

    def check(self, held: dict) -> None:
        """Invariants: every page is free xor owned by exactly the holder that lists it."""
        listed: dict[int, object] = {}
        for owner, pages in held.items():
            for p in pages:
                if p in listed:
                    raise AssertionError(f"page {p} held by both {listed[p]!r} and {owner!r}")
                listed[p] = owner
        if listed != self._owner:
            raise AssertionError(f"allocator owners {self._owner} differ from holders {listed}")
        free = set(self._free)
        if len(free) != len(self._free) or free & set(listed) or len(free) + len(listed) != self.num_pages:
            raise AssertionError("free list is inconsistent: leaked or duplicated pages")
