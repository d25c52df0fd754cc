import collections, sys
ORDER = ["decoder layers: linear kernels, norms, rope (kernel)", "attention (kernel)", "LM head (kernel)",
         "proposing", "verification and sampling", "cache bookkeeping", "model forward: Python and torch glue",
         "engine Python (scheduler, step runner, detokenizing)"]
def categorize(path):
    cats=collections.Counter(); n=0
    for line in open(path):
        stack,_,c=line.rpartition(' '); c=int(c)
        if 'StepRunner.step' not in stack: continue   # decode steps only (not the prompt's prefill)
        n+=c
        s=';'.join(f.split(' (')[0] for f in stack.split(';'))
        if any(x in s for x in ('values_avx','scores_avx','softmax_','attend_all','paged_attention')): cat=ORDER[1]
        elif 'QuantLinear.forward' in s: cat=ORDER[2]
        elif any(x in s for x in ('groups_simd','unpack<','qmatmul','rms_norm','layer_step')): cat=ORDER[0]
        elif 'propose' in s.lower() or 'Proposer' in s: cat=ORDER[3]
        elif any(x in s for x in ('verify','accept','sample','race','argmax','greedy')): cat=ORDER[4]
        elif any(x in s for x in ('commit','KVCache','reserve','CacheContext')): cat=ORDER[5]
        elif 'LlamaForCausalLM.forward' in s: cat=ORDER[6]
        else: cat=ORDER[7]
        cats[cat]+=c
    return n, cats
for path in sys.argv[1:]:
    n, cats = categorize(path)
    print(f"{path}: {n} samples in decode steps")
    for k in ORDER: print(f"  {cats[k]/n:6.1%} {k}")
