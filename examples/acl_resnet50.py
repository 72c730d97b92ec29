"""ResNet-50 through opencann's AscendCL-style facade, following pyACL's classic sample
flow: init -> set_device -> create_context/stream -> load_from_file -> model desc ->
malloc + memcpy the input -> datasets -> execute -> memcpy the output back -> top-5 ->
release everything -> finalize.

    python examples/acl_resnet50.py                   # compile opencann.zoo's resnet50, save, run
    python examples/acl_resnet50.py --size 64         # a smaller image (faster)
    python examples/acl_resnet50.py --model m.ocm     # run a saved model (input from its desc)

The zoo's ResNet-50 has seeded random weights and no classifier head: the "top-5" are
the five largest pooled features, printed to show the flow end to end. Each acl call's
return code is checked as pyACL samples do (`check`)."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import opencann  # noqa: E402
import opencann.acl as acl  # noqa: E402


def check(ret, what: str) -> None:
    if ret != acl.ACL_SUCCESS:
        raise RuntimeError(f"{what} failed, ret={ret} ({acl.errors.NAMES.get(ret, '?')})")


def image_for(dims) -> np.ndarray:
    """An input of ``dims``: the zoo's sample photo for [N, 3, H, W] (H == W), else random."""
    from opencann.zoo import sample_image
    if len(dims) == 4 and dims[1] == 3 and dims[2] == dims[3]:
        return sample_image(dims[2]).expand(dims[0], -1, -1, -1).contiguous().numpy()
    return torch.randn(*dims, generator=torch.Generator().manual_seed(0)).numpy()


def run(model_path: str, device_id: int = 0):
    """The pyACL flow on ``model_path``; returns (input array, list of output arrays)."""
    check(acl.init(), "acl.init")
    check(acl.rt.set_device(device_id), "acl.rt.set_device")
    context, ret = acl.rt.create_context(device_id)
    check(ret, "acl.rt.create_context")
    stream, ret = acl.rt.create_stream()
    check(ret, "acl.rt.create_stream")
    model_id, ret = acl.mdl.load_from_file(model_path)
    check(ret, "acl.mdl.load_from_file")
    desc = acl.mdl.create_desc()
    check(acl.mdl.get_desc(desc, model_id), "acl.mdl.get_desc")

    dims, ret = acl.mdl.get_input_dims(desc, 0)
    check(ret, "acl.mdl.get_input_dims")
    x = image_for(dims["dims"])
    in_size = acl.mdl.get_input_size_by_index(desc, 0)
    in_dev, ret = acl.rt.malloc(in_size, acl.ACL_MEM_MALLOC_HUGE_FIRST)
    check(ret, "acl.rt.malloc")
    check(acl.rt.memcpy(in_dev, in_size, acl.util.numpy_to_ptr(x), x.nbytes,
                        acl.ACL_MEMCPY_HOST_TO_DEVICE), "acl.rt.memcpy")
    in_ds = acl.mdl.create_dataset()
    _, ret = acl.mdl.add_dataset_buffer(in_ds, acl.create_data_buffer(in_dev, in_size))
    check(ret, "acl.mdl.add_dataset_buffer")

    out_ds, out_dev = acl.mdl.create_dataset(), []
    for i in range(acl.mdl.get_num_outputs(desc)):
        size = acl.mdl.get_output_size_by_index(desc, i)
        dev, ret = acl.rt.malloc(size, acl.ACL_MEM_MALLOC_HUGE_FIRST)
        check(ret, "acl.rt.malloc")
        _, ret = acl.mdl.add_dataset_buffer(out_ds, acl.create_data_buffer(dev, size))
        check(ret, "acl.mdl.add_dataset_buffer")
        out_dev.append((dev, size))

    check(acl.mdl.execute_async(model_id, in_ds, out_ds, stream), "acl.mdl.execute_async")
    check(acl.rt.synchronize_stream(stream), "acl.rt.synchronize_stream")

    outs = []
    for i, (dev, size) in enumerate(out_dev):
        odims, ret = acl.mdl.get_output_dims(desc, i)
        check(ret, "acl.mdl.get_output_dims")
        host = np.empty(size, dtype=np.uint8)
        check(acl.rt.memcpy(acl.util.numpy_to_ptr(host), size, dev, size,
                            acl.ACL_MEMCPY_DEVICE_TO_HOST), "acl.rt.memcpy")
        dtype = acl.acl_to_dtype(acl.mdl.get_output_data_type(desc, i))
        outs.append(torch.from_numpy(host).view(dtype).reshape(odims["dims"]).numpy())

    for ds in (in_ds, out_ds):
        for i in range(acl.mdl.get_dataset_num_buffers(ds)):
            check(acl.destroy_data_buffer(acl.mdl.get_dataset_buffer(ds, i)), "acl.destroy_data_buffer")
        check(acl.mdl.destroy_dataset(ds), "acl.mdl.destroy_dataset")
    for dev in [in_dev] + [d for d, _ in out_dev]:
        check(acl.rt.free(dev), "acl.rt.free")
    check(acl.mdl.destroy_desc(desc), "acl.mdl.destroy_desc")
    check(acl.mdl.unload(model_id), "acl.mdl.unload")
    check(acl.rt.destroy_stream(stream), "acl.rt.destroy_stream")
    check(acl.rt.destroy_context(context), "acl.rt.destroy_context")
    check(acl.rt.reset_device(device_id), "acl.rt.reset_device")
    check(acl.finalize(), "acl.finalize")
    return x, outs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a saved .ocm model (default: compile the zoo's resnet50)")
    ap.add_argument("--size", type=int, default=224, help="image size when compiling (default 224)")
    ap.add_argument("--device", default="cpu", help="compile for this device (cpu, vnpu:<preset>)")
    args = ap.parse_args(argv)
    cm, path = None, args.model
    if path is None:
        from opencann.zoo import resnet50, sample_image
        zm = resnet50(size=args.size)
        cm = opencann.compile(zm.model, (sample_image(args.size),), device=args.device)
        path = os.path.join(tempfile.mkdtemp(), "resnet50.ocm")
        opencann.save(cm, path)
        print(f"compiled resnet50 ({args.size}x{args.size}, {args.device}) and saved {path}")
    x, outs = run(path)
    scores = outs[-1].reshape(outs[-1].shape[0], -1)[0]
    top = np.argsort(-scores, kind="stable")[:5]
    print("top-5:", ", ".join(f"#{i} {scores[i]:.4f}" for i in top))
    if cm is not None:
        import torch.utils._pytree as pytree
        want = [t for t in pytree.tree_leaves(cm(torch.from_numpy(x))) if isinstance(t, torch.Tensor)]
        same = all(o.tobytes() == w.numpy().tobytes() for o, w in zip(outs, want))
        print(f"acl outputs equal the compiled model's bit for bit: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
