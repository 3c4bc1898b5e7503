// A Node.js client of nanoserve that knows nothing but the .proto contract: proof that any
// language with gRPC can stream from the server.
//
//   node generate.mjs ADDRESS[,ADDRESS...] [--max-tokens N] [--prompt-ids 785,9396,374] [--timeout-s S]
//                     [--temperature T --seed S --top-k K --top-p P]
//
// Asks GetModelInfo, streams one Generate of exactly N tokens (ignore_eos; greedy unless a
// temperature is given, with the sampling controls given), checks the stream, and prints one JSON line:
//   {"model", "prompt_token_ids", "token_ids", "text", "usage", "finish_reason"}
// Several addresses are replicas of one model: a stream that breaks with UNAVAILABLE is sent to the
// next with the tokens received so far (GenerateRequest.resume) and goes on where it broke, saying
// so on stderr. Any failure (bad arguments, an RPC error, a wrong stream, the timeout) exits
// non-zero with a message on stderr.
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';

const PROTO_ROOT = fileURLToPath(new URL('../../../proto', import.meta.url));
const REQUEST_ID = 'node-client';
// Qwen3 tokens of "The sea is calm tonight, and"; any ids below the vocabulary size would do.
const DEFAULT_PROMPT_IDS = '785,9396,374,19300,17913,11,323';

function parseCommandLine(argv) {
  const { values, positionals } = parseArgs({
    args: argv,
    allowPositionals: true,
    options: {
      'max-tokens': { type: 'string', default: '16' },
      'prompt-ids': { type: 'string', default: DEFAULT_PROMPT_IDS },
      'timeout-s': { type: 'string', default: '60' },
      temperature: { type: 'string', default: '0' },
      seed: { type: 'string' },
      'top-k': { type: 'string' },
      'top-p': { type: 'string' },
    },
  });
  if (positionals.length !== 1) throw new Error('expected exactly one ADDRESS (host:port, or several comma-separated)');
  const promptIds = values['prompt-ids'].split(',').map((id) => naturalNumber(id, 'a prompt id'));
  // Sampling controls: optional fields, sent only when given (the server's defaults otherwise).
  const sampling = { temperature: number(values.temperature, '--temperature') };
  if (values.seed !== undefined) sampling.seed = naturalNumber(values.seed, '--seed');
  if (values['top-k'] !== undefined) sampling.top_k = naturalNumber(values['top-k'], '--top-k');
  if (values['top-p'] !== undefined) sampling.top_p = number(values['top-p'], '--top-p');
  return {
    addresses: positionals[0].split(','),
    promptIds,
    maxTokens: naturalNumber(values['max-tokens'], '--max-tokens', 1),
    timeoutMs: naturalNumber(values['timeout-s'], '--timeout-s', 1) * 1000,
    sampling,
  };
}

function number(text, what) {
  const value = Number(text);
  if (!Number.isFinite(value)) throw new Error(`${what} must be a number, got '${text}'`);
  return value;
}

function naturalNumber(text, what, min = 0) {
  const value = /^\s*\d+\s*$/.test(text) ? Number(text) : NaN;
  if (!(value >= min)) throw new Error(`${what} must be an integer >= ${min}, got '${text}'`);
  return value;
}

function connect(address) {
  const definition = protoLoader.loadSync('nanoserve/v1/llm.proto', {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // field names exactly as in the .proto: token_ids, finish_reason, ...
    enums: String,
    defaults: true,
    oneofs: true,
  });
  const { LLM } = grpc.loadPackageDefinition(definition).nanoserve.v1;
  return new LLM(address, grpc.credentials.createInsecure());
}

function getModelInfo(client, deadline) {
  return new Promise((resolve, reject) => {
    client.GetModelInfo({}, { deadline }, (err, info) => (err ? reject(err) : resolve(info)));
  });
}

function generate(client, request, deadline, messages) {
  return new Promise((resolve, reject) => {
    const call = client.Generate(request, { deadline });
    call.on('data', (message) => messages.push(message));
    call.on('error', reject);
    call.on('end', () => resolve(messages));
  });
}

// The stream over replicas: after a break, the same request resuming the one completion after the
// tokens (and text) it carried; each replica once in a row without a message before giving up.
async function generateWithFailover(clients, addresses, request, deadline) {
  const messages = [];
  for (let replica = 0, failed = 0; ; replica = (replica + 1) % clients.length) {
    const before = messages.length;
    const token_ids = messages.flatMap((message) => message.token_ids);
    const text = messages.map((message) => message.text).join('');
    const resume = before ? [{ index: 0, token_ids, text }] : [];
    try {
      return await generate(clients[replica], { ...request, resume }, deadline, messages);
    } catch (err) {
      failed = messages.length > before ? 1 : failed + 1;
      if (err.code !== grpc.status.UNAVAILABLE || failed >= clients.length) throw err;
      const next = addresses[(replica + 1) % clients.length];
      console.error(`generate.mjs: the stream from ${addresses[replica]} broke (${err.details}): resuming after ` +
                    `${messages.flatMap((message) => message.token_ids).length} token(s) on ${next}`);
    }
  }
}

function check(condition, message) {
  if (!condition) throw new Error(message);
}

// Joins the streamed messages into one result, checking what the API promises about them.
function collect(messages, promptIds, maxTokens) {
  check(messages.length > 0, 'Generate streamed no message');
  const last = messages[messages.length - 1];
  for (const message of messages) {
    check(message.request_id === REQUEST_ID, `request_id not echoed: '${message.request_id}'`);
    const finishReason = message === last ? 'FINISH_REASON_LENGTH' : 'FINISH_REASON_UNSPECIFIED';
    check(message.finish_reason === finishReason, `finish_reason ${message.finish_reason}, expected ${finishReason}`);
  }
  const tokenIds = messages.flatMap((message) => message.token_ids);
  const { usage } = last;
  check(usage !== null, 'the last message carries no usage');
  check(tokenIds.length === maxTokens, `streamed ${tokenIds.length} tokens, asked for ${maxTokens}`);
  check(usage.completion_tokens === maxTokens, `usage.completion_tokens ${usage.completion_tokens} != ${maxTokens}`);
  check(usage.prompt_tokens === promptIds.length, `usage.prompt_tokens ${usage.prompt_tokens} != ${promptIds.length}`);
  return {
    prompt_token_ids: promptIds,
    token_ids: tokenIds,
    text: messages.map((message) => message.text).join(''),
    usage,
    finish_reason: last.finish_reason,
  };
}

async function main() {
  const { addresses, promptIds, maxTokens, timeoutMs, sampling } = parseCommandLine(process.argv.slice(2));
  const deadline = new Date(Date.now() + timeoutMs);
  const clients = addresses.map(connect);
  try {
    const info = await getModelInfo(clients[0], deadline);
    const outOfVocab = promptIds.filter((id) => id >= info.vocab_size);
    check(outOfVocab.length === 0, `prompt ids ${outOfVocab} are outside the vocabulary of ${info.vocab_size}`);
    const request = {
      request_id: REQUEST_ID,
      token_ids: { ids: promptIds },
      sampling: { ...sampling, max_tokens: maxTokens, ignore_eos: true },
    };
    const messages = await generateWithFailover(clients, addresses, request, deadline);
    console.log(JSON.stringify({ model: info.model, ...collect(messages, promptIds, maxTokens) }));
  } finally {
    clients.forEach((client) => client.close());
  }
}

main().catch((err) => {
  console.error(`generate.mjs: ${err.message}`);
  process.exit(1);
});
