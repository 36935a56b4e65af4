"""Models whose loss is not a cross entropy on logits, from libraries nothing like transformers,
in fp32 and under bf16 autocast (the twenty-fifth probe).

    python benchmarks/probabilistic_probe.py [model ...] [-n 6] [--fp32-only]

Gaussian processes (gpytorch): deep kernel learning, an MLP's features under an RBF kernel, the
exact marginal likelihood computed lazily by linear_operator's own autograd functions, once by
Cholesky and once by conjugate gradients with random probe vectors (the model returns a
MultivariateNormal, the loss is taken from it outside the model), and a sparse variational GP on
a convolutional feature extractor trained by its ELBO; TabNet (pytorch-tabnet): sequential
attention whose masks come from sparsemax or entmax (custom autograd functions that sort), ghost
batch norm over chunks of the batch, categorical embeddings, its sparsity loss subtracted from the
loss; a Kolmogorov-Arnold network (pykan), B-spline activations whose inputs and outputs it keeps
on its modules after every forward; sentence embeddings (sentence-transformers), a BERT
bi-encoder trained by in-batch negatives (the loss module calls the model twice per step on a
list of feature dicts), and by the cached variant (GradCache: embeddings without grad, then a
hook on the loss runs forward and backward again, mini-batch by mini-batch, inside backward); a
VAE trained by Pyro's ELBO (sampling sites, a plate, the loss from a traced model and guide); and
PPO (torchrl): an actor-critic loss module called on a TensorDict, a tanh-normal policy whose
entropy is sampled. Then as `families_probe.py` does: planned at its smallest peak and half way,
each plan verified and run on a smaller batch, and `-n` schedules near the smallest-peak one
measured.

Needs ``pip install --no-deps gpytorch linear_operator jaxtyping wadler_lindig pytorch-tabnet
scikit-learn joblib threadpoolctl cloudpickle narwhals pykan pandas python-dateutil pytz tzdata
sentence-transformers pyro-ppl pyro-api tensordict torchrl pyvers orjson`` (and scipy, sympy,
matplotlib, tqdm, pyyaml). Not part of the test suite.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks import families_probe  # noqa: E402
from benchmarks.libraries_probe import _labels_loss  # noqa: E402
from tests.zoo import Case  # noqa: E402

# -- gpytorch ----------------------------------------------------------------------------------


def _mlp(d_in: int, d_out: int, hidden: int = 256) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, d_out))


class _TrainOn(nn.Module):
    """Deep kernel learning as gpytorch's example trains it, on whichever batch it is given: the
    GP's training data set to the batch, then the GP called on it (an ExactGP in train mode
    refuses any input but its training data)."""

    def __init__(self, gp: Any) -> None:
        super().__init__()
        self.gp = gp

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        self.gp.set_train_data(x, y, strict=False)
        return self.gp(x)


def _dkl_exact(cg: bool) -> Callable[[], Case]:
    def make() -> Case:
        import gpytorch

        torch.manual_seed(0)

        class DKL(gpytorch.models.ExactGP):
            def __init__(self, likelihood: Any) -> None:
                super().__init__(None, None, likelihood)
                self.features = _mlp(32, 8)
                self.scale = gpytorch.utils.grid.ScaleToBounds(-1.0, 1.0)
                self.mean = gpytorch.means.ConstantMean()
                self.covar = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

            def forward(self, x: torch.Tensor) -> Any:
                z = self.scale(self.features(x))
                return gpytorch.distributions.MultivariateNormal(self.mean(z), self.covar(z))

        likelihood = gpytorch.likelihoods.GaussianLikelihood()
        gp = DKL(likelihood)
        mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, gp)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(512, 32, generator=g)
        y = torch.sin(x[:, :4].sum(1)) + 0.1 * torch.randn(512, generator=g)

        def loss_fn(out: Any) -> torch.Tensor:
            n = out.event_shape[0]
            with gpytorch.settings.max_cholesky_size(0 if cg else 10_000):
                return -mll(out, y[:n])

        return Case(_TrainOn(gp).train(), (x, y), loss_fn, (x[:128], y[:128]), "plain")

    return make


class _SVGP(nn.Module):
    """A sparse variational GP on a small CNN's features (images to a regression target)."""

    def __init__(self) -> None:
        super().__init__()
        import gpytorch

        torch.manual_seed(0)

        class GP(gpytorch.models.ApproximateGP):
            def __init__(self, inducing: torch.Tensor) -> None:
                q = gpytorch.variational.CholeskyVariationalDistribution(inducing.shape[0])
                s = gpytorch.variational.VariationalStrategy(self, inducing, q,
                                                            learn_inducing_locations=True)
                super().__init__(s)
                self.mean = gpytorch.means.ConstantMean()
                self.covar = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5))

            def forward(self, z: torch.Tensor) -> Any:
                return gpytorch.distributions.MultivariateNormal(self.mean(z), self.covar(z))

        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 7 * 7, 16))
        self.gp = GP(torch.randn(64, 16))
        self.likelihood = gpytorch.likelihoods.GaussianLikelihood()

    def forward(self, images: torch.Tensor) -> Any:
        z = self.features(images)
        with torch.autocast(images.device.type, enabled=False):  # the GP in fp32, as AMP users do
            return self.gp(z.float())


def _svgp() -> Case:
    import gpytorch

    model = _SVGP()
    elbo = gpytorch.mlls.VariationalELBO(model.likelihood, model.gp, num_data=60_000)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 1, 28, 28, generator=g)
    y = torch.randn(128, generator=g)

    def loss_fn(out: Any) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return -elbo(out, y[: out.event_shape[0]])

    return Case(model.train(), (x,), loss_fn, (x[:32],), "plain")


# -- TabNet ------------------------------------------------------------------------------------


def _tabnet(mask: str) -> Callable[[], Case]:
    def make() -> Case:
        from pytorch_tabnet.tab_network import TabNet
        from pytorch_tabnet.utils import create_group_matrix

        torch.manual_seed(0)
        model = TabNet(input_dim=24, output_dim=5, n_d=32, n_a=32, n_steps=4, cat_idxs=[0, 1, 2],
                       cat_dims=[12, 7, 30], cat_emb_dim=[4, 3, 6], virtual_batch_size=64,
                       mask_type=mask, group_attention_matrix=create_group_matrix([], 24))
        g = torch.Generator().manual_seed(1)
        x = torch.randn(512, 24, generator=g)
        for col, card in ((0, 12), (1, 7), (2, 30)):
            x[:, col] = torch.randint(0, card, (512,), generator=g).float()
        labels = torch.randint(0, 5, (512,), generator=g)

        def loss_fn(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            logits, sparsity = out
            return F.cross_entropy(logits.float(), labels[: logits.shape[0]]) - 1e-3 * sparsity

        return Case(model.train(), (x,), loss_fn, (x[:128],), "plain")

    return make


# -- KAN ---------------------------------------------------------------------------------------


def _kan() -> Case:
    from kan import KAN

    model = KAN(width=[16, 32, 32, 4], grid=8, k=3, seed=0, auto_save=False,
                ckpt_path=tempfile.mkdtemp())
    g = torch.Generator().manual_seed(1)
    x = torch.rand(1024, 16, generator=g) * 2 - 1
    labels = torch.randint(0, 4, (1024,), generator=g)
    return Case(model.train(), (x,), _labels_loss(labels), (x[:256],), "plain")


# -- sentence-transformers ---------------------------------------------------------------------


def _bi_encoder() -> Any:
    """A SentenceTransformer (BERT, mean pooling) from a random small config, saved to a
    temporary folder with a made-up word-piece vocabulary so that the library loads it."""
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path = tempfile.mkdtemp()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(995)]
    Path(path, "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(str(Path(path, "vocab.txt"))).save_pretrained(path)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=3,
                         num_attention_heads=4, intermediate_size=512,
                         max_position_embeddings=128)).save_pretrained(path)
    bert = models.Transformer(path, max_seq_length=128)
    return SentenceTransformer(modules=[bert, models.Pooling(128, "mean")], device="cpu")


def _features(batch: int, length: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Padded token ids and their attention mask, as the model's tokenizer would give them."""
    ids = torch.randint(5, 1000, (batch, length), generator=g)
    lengths = torch.randint(length // 3, length + 1, (batch,), generator=g)
    lengths[0] = length
    mask = (torch.arange(length) < lengths[:, None]).long()
    ids[:, 0] = 2
    ids = torch.where(mask.bool(), ids, 0)
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}


def _sbert(cached: bool) -> Callable[[], Case]:
    def make() -> Case:
        from sentence_transformers import losses

        model = _bi_encoder()
        loss = (losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=8) if cached
                else losses.MultipleNegativesRankingLoss(model))
        g = torch.Generator().manual_seed(1)
        big = [_features(32, 64, g), _features(32, 64, g)]
        small = [_features(8, 32, g), _features(8, 32, g)]
        return Case(loss.train(), (big, None), lambda out: out, (small, None), "encoder")

    return make


# -- Pyro --------------------------------------------------------------------------------------


class _PyroVAE(nn.Module):
    """A convolutional VAE on 28 x 28 binary images; forward returns Pyro's Trace_ELBO loss of
    the model and guide below (what `SVI.step` differentiates)."""

    def __init__(self, z: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.z = z
        self.encoder = nn.Sequential(
            nn.Conv2d(1, 32, 4, 2, 1), nn.ReLU(), nn.Conv2d(32, 64, 4, 2, 1), nn.ReLU(),
            nn.Flatten(), nn.Linear(64 * 7 * 7, 256), nn.ReLU(), nn.Linear(256, 2 * z))
        self.decoder = nn.Sequential(
            nn.Linear(z, 256), nn.ReLU(), nn.Linear(256, 64 * 7 * 7), nn.ReLU(),
            nn.Unflatten(1, (64, 7, 7)), nn.ConvTranspose2d(64, 32, 4, 2, 1), nn.ReLU(),
            nn.ConvTranspose2d(32, 1, 4, 2, 1))

    def model(self, x: torch.Tensor) -> None:
        import pyro
        import pyro.distributions as dist

        pyro.module("decoder", self.decoder)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(x.shape[0], self.z),
                                             x.new_ones(x.shape[0], self.z)).to_event(1))
            logits = self.decoder(z).float()
            pyro.sample("obs", dist.Bernoulli(logits=logits).to_event(3), obs=x)

    def guide(self, x: torch.Tensor) -> None:
        import pyro
        import pyro.distributions as dist

        pyro.module("encoder", self.encoder)
        with pyro.plate("data", x.shape[0]):
            loc, scale = self.encoder(x).float().chunk(2, dim=-1)
            pyro.sample("z", dist.Normal(loc, F.softplus(scale) + 1e-4).to_event(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import pyro

        return pyro.infer.Trace_ELBO().differentiable_loss(self.model, self.guide, x) / len(x)


def _pyro_vae() -> Case:
    model = _PyroVAE()
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(128, 1, 28, 28, generator=g) < 0.3).float()
    return Case(model.train(), (x,), lambda out: out, (x[:32],), "plain")


# -- torchrl -----------------------------------------------------------------------------------


def _ppo() -> Case:
    from tensordict import TensorDict
    from tensordict.nn import NormalParamExtractor, TensorDictModule
    from torchrl.modules import ProbabilisticActor, TanhNormal, ValueOperator
    from torchrl.objectives import ClipPPOLoss

    torch.manual_seed(0)
    obs, act = 48, 12
    policy = TensorDictModule(
        nn.Sequential(_mlp(obs, 2 * act, 512), NormalParamExtractor()),
        in_keys=["observation"], out_keys=["loc", "scale"])
    actor = ProbabilisticActor(policy, in_keys=["loc", "scale"], distribution_class=TanhNormal,
                               distribution_kwargs={"low": -1.0, "high": 1.0},
                               return_log_prob=True)
    critic = ValueOperator(_mlp(obs, 1, 512), in_keys=["observation"])
    loss = ClipPPOLoss(actor, critic, clip_epsilon=0.2, entropy_bonus=True, entropy_coeff=1e-2,
                       critic_coeff=0.5)
    g = torch.Generator().manual_seed(1)

    def batch(n: int) -> Any:
        action = torch.rand(n, act, generator=g) * 1.8 - 0.9
        return TensorDict({
            "observation": torch.randn(n, obs, generator=g),
            "action": action,
            "action_log_prob": torch.randn(n, generator=g) - 5.0,
            "advantage": torch.randn(n, 1, generator=g),
            "value_target": torch.randn(n, 1, generator=g),
        }, batch_size=[n])

    def loss_fn(out: Any) -> torch.Tensor:
        return out["loss_objective"] + out["loss_critic"] + out["loss_entropy"]

    return Case(loss.train(), (batch(2048),), loss_fn, (batch(256),), "plain")


MODELS: dict[str, Callable[[], Case]] = {
    "dkl_exact_cholesky": _dkl_exact(False),
    "dkl_exact_cg": _dkl_exact(True),
    "svgp_cnn": _svgp,
    "tabnet_sparsemax": _tabnet("sparsemax"),
    "tabnet_entmax": _tabnet("entmax"),
    "kan": _kan,
    "sbert_mnrl": _sbert(False),
    "sbert_cached_mnrl": _sbert(True),
    "pyro_vae": _pyro_vae,
    "ppo_torchrl": _ppo,
}


def main(argv: list[str] | None = None) -> int:
    return families_probe.main(argv, MODELS, "model", __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
