"""Layout presets read through hydra's compose API (the same files the scripts use)."""


from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from parallelism.layout import Layout
from tests.support.paths import REPO_ROOT

CONF = str(REPO_ROOT / "conf")
PRESETS = ("single", "tp8", "ep8", "dp8_ep8", "tp2_ep4", "tp4_ep2", "tp2xdp4_ep8")


def compose_config(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose(config_name=name, overrides=overrides)


def layout(preset: str, *overrides: str) -> Layout:
    cfg = compose_config("logits", [f"parallel={preset}", *[f"parallel.{o}" for o in overrides]])
    return Layout(**OmegaConf.to_container(cfg.parallel))
