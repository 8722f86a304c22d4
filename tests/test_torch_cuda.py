"""PyTorch adapter, CUDA only: graphs, streams, devices, allocator, no syncs."""

import pytest

torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")

import cupy_act.torch as ct  # noqa: E402
from cupy_act import testing  # noqa: E402
from cupy_act.testing import assert_bits_equal  # noqa: E402

pytestmark = pytest.mark.gpu


def test_cuda_graph_capture_forward_and_backward():
    x = testing.make_input(1 << 16, torch.float32, seed=1).requires_grad_(True)
    dy = testing.make_input(1 << 16, torch.float32, seed=2)
    static_x = x.detach().clone().requires_grad_(True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: compile and load before capture
        for _ in range(2):
            y = ct.div_leaky_relu(static_x, 2.0, 0.1)
            y.backward(dy)
    torch.cuda.current_stream().wait_stream(s)
    static_x.grad = None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = ct.div_leaky_relu(static_x, 2.0, 0.1)
        y.backward(dy)
    for seed in (3, 4):
        new = testing.make_input(1 << 16, torch.float32, seed=seed)
        with torch.no_grad():
            static_x.copy_(new)
        g.replay()
        torch.cuda.synchronize()
        assert_bits_equal(y, testing.forward("div_leaky_relu", new, 0.1, 2.0), "graph forward")
        assert_bits_equal(
            static_x.grad, testing.backward("div_leaky_relu", new, dy, 0.1, 2.0), "graph backward"
        )


def test_runs_on_torch_current_stream_behind_long_work():
    n = 1 << 22
    final = testing.make_input(n, torch.float32, seed=5)
    a = torch.randn(4096, 4096, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.zeros(n, device="cuda")
        for _ in range(20):
            a = a @ a * 1e-3  # long queue ahead of the copy
        x.copy_(final)
        y = ct.leaky_relu(x.requires_grad_(True), 0.05)
        (dx,) = torch.autograd.grad(y, x, final)
    side.synchronize()
    assert_bits_equal(y, testing.forward("leaky_relu", final, 0.05), "side stream forward")
    assert_bits_equal(dx, testing.backward("leaky_relu", final, final, 0.05), "side stream grad")


def test_tensor_on_second_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    x = testing.make_input(4097, torch.float32, device="cuda:1", seed=6)
    with torch.cuda.device(0):
        y = ct.div_leaky_relu(x.clone().requires_grad_(True), 3.0)
        assert y.device == x.device
    assert_bits_equal(y, testing.forward("div_leaky_relu", x, 0.01, 3.0), "cuda:1")


def test_cupy_pool_untouched_and_no_host_sync():
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    used = pool.total_bytes()
    x = torch.randn(1 << 20, device="cuda", requires_grad=True)
    ct.relu(x)  # first call compiles/loads outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for inplace in (False, True):
            h = x * 1
            y = ct.div_leaky_relu(h, 2.0, inplace=inplace)
            y = ct.leaky_relu(ct.relu(y), 0.1)
            y.backward(torch.ones_like(y))
        with torch.no_grad():
            ct.leaky_relu(x, 0.2)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert pool.total_bytes() == used, "CuPy's memory pool was used"


def test_conv_module_channels_last_faster_path_is_close():
    torch.manual_seed(0)
    m = ct.ConvDivLeakyReLU(8, 64, 3, divisor=2).cuda()
    cl = ct.ConvDivLeakyReLU(8, 64, 3, divisor=2, channels_last=True).cuda()
    cl.load_state_dict(m.state_dict())
    x = torch.randn(4, 8, 64, 64, device="cuda")
    ref = torch.nn.functional.leaky_relu(m.conv(x) / 2, 0.01)
    assert_bits_equal(m(x), ref, "default mode")
    y = cl(x)
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=5e-3)  # TF32 convolution
