"""Oracle hints for the speculative-engine tests (`SpecEngine.generate(..., hint=...)`)."""


def oracle_hint(ref: list[list[int]], gamma: int, vocab: int):
    """hint(i, out): the AR continuation of request i after `out`, with one wrong token at a position that
    cycles with progress — so long acceptances, partial acceptances and rejections all occur."""
    def hint(i, out):
        g = len(out)
        h = list(ref[i][g:g + gamma])
        k = g % (gamma + 1)
        if k < len(h):
            h[k] = (h[k] + 1) % vocab
        return h
    return hint
