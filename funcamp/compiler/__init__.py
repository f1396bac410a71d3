"""funcamp's changes to torch's compiler, off torch's default path and in one place.

This package owns every place where funcamp changes what dynamo or inductor do, as opposed to
what it asks of them through public options:

* :mod:`~funcamp.compiler.cpp_bundle`: a compiled step's CPU kernels built in a few C++ units,
  instead of one ``g++`` process per kernel (inductor's ``AsyncCompile.cpp_pybinding`` and
  ``PythonWrapperCodegen.define_kernel``);
* :mod:`~funcamp.compiler.dead_stores`: no dead readers stored before an in-place write
  (inductor's ``GraphLowering.mark_buffer_mutated``);
* :mod:`~funcamp.compiler.layouts`: a post-grad pass that keeps the activations a convolution's
  backward shares channels-last (a ``CustomGraphPass``, inductor's option);
* :mod:`~funcamp.compiler.cross_entropy`: a ``CrossEntropyLoss`` built inside a traced
  :func:`funcamp.amp` function reaches the amp mode, as in eager code (dynamo's
  ``UserDefinedClassVariable._call_cross_entropy_loss``);
* :mod:`~funcamp.compiler.keys`: which of them are on, in inductor's FX graph cache key;
* :mod:`~funcamp.compiler.gate`: when they are on. An explicit choice wins (``compiler_patches=``
  of :func:`funcamp.make_train_step` and :func:`funcamp.make_eval_step`, or a
  :func:`compiler_patches` block). Else they are on only for the torch releases and devices of
  :data:`ALLOWLIST`.

Nothing here runs at ``import funcamp``. :mod:`~funcamp.compiler.hooks` loads the patch modules
(and the inductor modules they use) at funcamp's first compile. Each is installed once, under a
lock. Each acts only inside a block entered by funcamp's own compile in that thread. (A
``torch.compile`` of anything else, in any thread, runs torch's code.) Each leaves torch alone
where its internals are not the ones it was written against. Training code calls this package;
it imports nothing of training.
"""

from funcamp.compiler.gate import ALLOWLIST as ALLOWLIST
from funcamp.compiler.gate import compiler_patches, patches_on, torch_release

__all__ = ["compiler_patches", "patches_on", "torch_release"]
