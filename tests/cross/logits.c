// A GGUF's logits along a given sequence through llama.cpp's C API, for a build of another
// architecture run under qemu-user (tests/test_ggml.py): compared with the ggml backend's
// logits on this machine.
//
//   logits MODEL.gguf THREADS PROMPT ID [ID ...]
//
// Fed as the engine feeds (backends/ggml.py): the first PROMPT - 1 ids in one batch, then
// the rest one at a time, flash attention on. Writes the logits read after each of those
// single ids to standard output as float32 in the machine's byte order: (count - PROMPT + 1)
// rows of the vocabulary's size.
#include <stdio.h>
#include <stdlib.h>

#include "llama.h"

static int fail(const char * what) {
    fprintf(stderr, "logits: %s\n", what);
    return 1;
}

int main(int argc, char ** argv) {
    if (argc < 5) {
        return fail("usage: logits MODEL.gguf THREADS PROMPT ID [ID ...]");
    }
    const int threads = atoi(argv[2]);
    const int prompt = atoi(argv[3]);
    const int count = argc - 4;
    if (prompt < 1 || prompt > count) {
        return fail("PROMPT must be between 1 and the number of ids");
    }
    llama_token * ids = malloc(sizeof(llama_token) * (size_t) count);
    for (int i = 0; i < count; i++) {
        ids[i] = (llama_token) atoi(argv[4 + i]);
    }

    llama_backend_init();
    struct llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (model == NULL) {
        return fail("the model did not load");
    }
    struct llama_context_params params = llama_context_default_params();
    params.n_ctx = (uint32_t) count;
    params.n_batch = params.n_ctx;
    params.n_threads = params.n_threads_batch = threads;
    params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    params.no_perf = true;
    struct llama_context * context = llama_init_from_model(model, params);
    if (context == NULL) {
        return fail("the context was not made");
    }
    const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    if (prompt > 1 && llama_decode(context, llama_batch_get_one(ids, prompt - 1)) != 0) {
        return fail("the prompt's read failed");
    }
    for (int i = prompt - 1; i < count; i++) {
        if (llama_decode(context, llama_batch_get_one(&ids[i], 1)) != 0) {
            return fail("a decoding step failed");
        }
        fwrite(llama_get_logits_ith(context, -1), sizeof(float), (size_t) vocab, stdout);
    }

    llama_free(context);
    llama_model_free(model);
    llama_backend_free();
    free(ids);
    return 0;
}
