"""Instruments of the stage budget: where a loader's time goes, alone and beside a training step.

``stages`` (a ThreadLoader's host seconds per stage; nvImageCodec alone on whole images and regions),
``beside_step`` (the stages beside a training step and alone) and ``decoders_beside`` (nvImageCodec's
Decoders alone and beside a graphed step). Run them to re-check a decision, not to compare loaders;
they use the library's public API.
"""
