"""The baseline's loss-vs-budget law and the speedups read from it.

L(D) = beta + alpha * D**(-B): the end-of-schedule loss the baseline (AdamW) reaches
with a budget of D tokens, each budget its own run with its own schedule
(Wen et al., "Fantastic Pretraining Optimizers and Where to Find Them",
arXiv 2509.02046). A challenger that reaches loss L at budget D has token speedup
D_eff / D, D_eff being the budget the baseline's law needs for L.

Re-centred (as Marin's gate does): at each budget the law is shifted through the
baseline's own point there (beta_D = L_base(D) - alpha * D**-B), so that the
baseline is 1 by construction and a challenger is measured against the loss the
baseline really reached at that budget, the law giving only the exchange rate
between loss and tokens. Then
    D_eff / D = (1 + (L - L_base(D)) / (alpha * D**-B)) ** (-1 / B),
which is exactly 1 when L == L_base(D).

No numpy or scipy: the fit is a profile least squares (beta and alpha linear for a
fixed B, B by a bracketing search), exact on exact points to rounding."""
import math

__all__ = ["Law", "fit_law", "token_speedup", "wallclock_speedup"]


class Law:
    """L(D) = beta + alpha * D**(-B). residuals: observed - fitted, per point."""

    def __init__(self, alpha, B, beta, budgets=(), losses=(), residuals=()):
        self.alpha, self.B, self.beta = float(alpha), float(B), float(beta)
        self.budgets, self.losses = list(budgets), list(losses)
        self.residuals = list(residuals)
        self.notes = []

    def __call__(self, budget):
        return self.beta + self.alpha * float(budget) ** (-self.B)

    def budget_for(self, loss):
        """D with L(D) = loss (inf where loss <= beta: the law never gets there)."""
        gap = float(loss) - self.beta
        if gap <= 0:
            return math.inf
        return (gap / self.alpha) ** (-1.0 / self.B)

    def to_dict(self):
        return dict(alpha=self.alpha, B=self.B, beta=self.beta, budgets=self.budgets,
                    losses=self.losses, residuals=self.residuals, notes=self.notes)

    @classmethod
    def from_dict(cls, d):
        return cls(d["alpha"], d["B"], d["beta"], d.get("budgets", ()), d.get("losses", ()),
                   d.get("residuals", ()))

    def __repr__(self):
        return "Law(L(D) = %.6g + %.6g * D^-%.6g)" % (self.beta, self.alpha, self.B)


def _linear_fit(x, y, beta_min=None):
    """Least squares y = beta + alpha x, beta >= beta_min when given: (beta, alpha,
    sum of squared residuals)."""
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((a - mx) ** 2 for a in x)
    if sxx <= 0:
        return my, 0.0, sum((b - my) ** 2 for b in y)
    alpha = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx
    beta = my - alpha * mx
    if beta_min is not None and beta < beta_min:  # held at the floor: alpha alone
        beta = beta_min
        alpha = sum(a * (b - beta) for a, b in zip(x, y)) / sum(a * a for a in x)
    return beta, alpha, sum((b - beta - alpha * a) ** 2 for a, b in zip(x, y))


def fit_law(budgets, losses, B_range=(1e-3, 4.0), beta_min=0.0):
    """Fits L(D) = beta + alpha * D**(-B) to (budget, loss) points: at least 3
    distinct budgets; least squares in the loss, beta >= beta_min (a cross-entropy
    never falls below 0; None: unbounded). For each B the best beta and alpha are
    linear least squares; B minimises what is left (a log-spaced scan of B_range,
    then golden-section refinement to rounding). Exact points give the law back to
    rounding.

    law.notes says where the points do not look like the law: beta held at its
    floor, or B at an end of B_range. Both happen when the losses fall faster at
    the larger budgets (early in training, before the power-law regime): the law
    then only averages the exchange rate between loss and tokens over the budgets.

    Raises ValueError when the points cannot carry a decreasing law: fewer than 3
    budgets, or losses that do not fall with the budget (the best alpha <= 0)."""
    budgets, losses = list(budgets), list(losses)
    if len(budgets) != len(losses):
        raise ValueError("fit_law: %d budgets but %d losses" % (len(budgets), len(losses)))
    pts = sorted((float(d), float(l)) for d, l in zip(budgets, losses))
    if len({d for d, _ in pts}) < 3:
        raise ValueError("fit_law: needs losses at 3 or more distinct budgets, got %d (%s)"
                         % (len({d for d, _ in pts}), [d for d, _ in pts]))
    if any(d <= 0 or not math.isfinite(d) or not math.isfinite(l) for d, l in pts):
        raise ValueError("fit_law: budgets must be positive and losses finite: %s" % pts)
    D = [d for d, _ in pts]
    L = [l for _, l in pts]
    d0 = math.exp(sum(math.log(d) for d in D) / len(D))  # scale: D / d0 near 1
    r = [d / d0 for d in D]

    def profile(B):
        return _linear_fit([x ** (-B) for x in r], L, beta_min)

    lo, hi = math.log(B_range[0]), math.log(B_range[1])
    grid = [math.exp(lo + (hi - lo) * i / 400) for i in range(401)]
    sse = [profile(B)[2] for B in grid]
    i = min(range(len(grid)), key=lambda k: sse[k])
    a, b = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = profile(c)[2], profile(d)[2]
    for _ in range(200):
        if b - a <= 1e-15 * max(1.0, b):
            break
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = profile(c)[2]
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = profile(d)[2]
    B = min((a, b, c, d, grid[i]), key=lambda x: profile(x)[2])
    beta, alpha_s, _ = profile(B)
    if alpha_s <= 0:
        raise ValueError("fit_law: the losses do not fall with the budget (%s): no decreasing "
                         "law fits them" % ", ".join("%g: %.4f" % p for p in pts))
    alpha = alpha_s * d0 ** B  # alpha_s * (D / d0)^-B == alpha * D^-B
    law = Law(alpha, B, beta, D, L)
    law.residuals = [l - law(d) for d, l in pts]
    if beta_min is not None and beta <= beta_min:
        law.notes.append("beta held at its floor %g (unbounded, the fit wanted a lower one): the "
                         "losses do not bend like a power law over these budgets" % beta_min)
    if B <= B_range[0] * 1.05 or B >= B_range[1] / 1.05:
        law.notes.append("B = %.3g at an end of its search range %s: the losses do not bend like "
                         "a power law over these budgets" % (B, list(B_range)))
    return law


def token_speedup(law, loss, budget, baseline_loss=None):
    """D_eff / budget: the budget the law needs for `loss`, over `budget`.

    baseline_loss: the baseline's own loss at this budget; the law is then
    re-centred through it (see the module's note), so baseline_loss == loss gives
    exactly 1. inf when the loss lies beyond the law's floor (beta)."""
    if not isinstance(law, Law):
        law = Law.from_dict(law) if isinstance(law, dict) else Law(*law)
    D = float(budget)
    if baseline_loss is None:
        return law.budget_for(loss) / D
    base = 1.0 + (float(loss) - float(baseline_loss)) / (law.alpha * D ** (-law.B))
    if base <= 0:
        return math.inf
    return base ** (-1.0 / law.B)


def wallclock_speedup(law, loss, budget, tokens_per_s, baseline_tokens_per_s,
                      baseline_loss=None):
    """(time the baseline needs for D_eff tokens) / (time the challenger took for
    budget): (D_eff / baseline tokens/s) / (budget / challenger tokens/s)."""
    return (token_speedup(law, loss, budget, baseline_loss) * float(tokens_per_s)
            / float(baseline_tokens_per_s))
