from .build import FivarModule, gen_module

__all__ = ["FivarModule", "gen_module"]
