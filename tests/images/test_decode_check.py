"""The GPU JPEG path's pixels, run on the CPU in both images: tests/gpu/decode_check.py (what
`make smoke-gpu` runs on the GPU) decodes a batch with DeviceDecode's batched path
(torchvision's decode of a list, gpufeed's crop/resize/flip products) and compares it with
torchvision's own resized_crop for the same boxes, in float64. The host's test environment
has no torchvision; the images have the one they ship."""

from __future__ import annotations

import json

from imagetools import CPU_ENV, REPO


def test_the_batched_gpu_decode_path_gives_torchvisions_pixels(
    run_container, ssh_image, jupyter_image
):
    for image in (ssh_image, jupyter_image):
        running = run_container(
            image,
            command=["python", "tests/gpu/decode_check.py", "--device", "cpu"],
            environment={**CPU_ENV, "GPUFEED_PREFLIGHT_QUIET": "1"},
            working_dir="/src",
            volumes={str(REPO): {"bind": "/src", "mode": "ro"}},
        )
        code = running.wait_exit(timeout=180)
        logs = running.logs()
        assert code == 0, (image, logs)
        result = json.loads([line for line in logs.splitlines() if line.startswith("{")][-1])
        assert result["images"] == 24 and 0 < result["flipped"] < 24, result
        assert result["max_difference"] <= 1 and result["fallbacks"] == 0, result


def test_boxes_through_the_crop_are_torchvisions(run_container, ssh_image):
    """Issue 38 item 2's bar: RandomResizedCrop(boxes=...) against torchvision v2's own box
    transform (tests/gpu/boxes_check.py), in the image that ships torchvision."""
    running = run_container(
        ssh_image,
        command=["python", "tests/gpu/boxes_check.py"],
        environment={**CPU_ENV, "GPUFEED_PREFLIGHT_QUIET": "1"},
        working_dir="/src",
        volumes={str(REPO): {"bind": "/src", "mode": "ro"}},
    )
    code = running.wait_exit(timeout=180)
    logs = running.logs()
    assert code == 0, logs
    result = json.loads([line for line in logs.splitlines() if line.startswith("{")][-1])
    assert result["ok"] and len(result["results"]) == 3, result
    assert all(r["dropped"] > 0 and 0 < r["flipped"] < result["samples"] for r in result["results"])
