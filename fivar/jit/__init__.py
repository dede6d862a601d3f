from .build import FivarModule, gen_module
from .module_key import ModuleKey

__all__ = ["FivarModule", "ModuleKey", "gen_module"]
