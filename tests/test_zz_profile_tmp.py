import time, cProfile, pstats, torch
import cudagraphs as cg
from cudagraphs.tools.workloads import LLAMA_SHAPES
from transformers import LlamaConfig, LlamaForCausalLM

def test_profile(stand_in):
    shape = dict(LLAMA_SHAPES["llama-2048"]); shape.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    config = LlamaConfig(**shape, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    from cudagraphs.decoding import Engine
    with torch.no_grad():
        engine = Engine(model, max_batch=64, max_length=1024)
        prompt = list(range(1, 17))
        for _ in range(3): engine.generate(prompt, max_new_tokens=1, eos_token_id=None)
        t = time.perf_counter()
        for _ in range(20): engine.generate(prompt, max_new_tokens=1, eos_token_id=None)
        print("per request ms", (time.perf_counter()-t)/20*1e3)
        t = time.perf_counter()
        for _ in range(3): engine.generate(prompt, max_new_tokens=40, eos_token_id=None)
        print("per request 40 ms", (time.perf_counter()-t)/3*1e3)
        prof = cProfile.Profile()
        import threading
        threading.setprofile(lambda *a: None)
        engine.close()
