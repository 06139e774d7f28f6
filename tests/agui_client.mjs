// Runs AG-UI's reference client, @ag-ui/client's HttpAgent (its own event verification on),
// against a Cortex API: tests/agui_client.py writes the plan on stdin and reads the report.
//
// Plan: {module, url, headers, threadId, messages, steps: [{runId, messages, tools,
// forwardedProps, headers, resume}]}: one agent, one runAgent per step, in order. A step's
// `messages` are added to the agent's before it runs; `resume` is a list of resume entries,
// or {approved, reason} to answer every pending interrupt of the agent that way (or
// {status: "cancelled"}). Report: per step {events, result, newMessages, pendingInterrupts,
// error}; plus the warnings the client printed (its enforcement strips what AG-UI does not
// define, with a warning) and the agent's messages at the end.
import { createRequire } from "node:module";

const plan = JSON.parse(await new Promise((resolve) => {
  let text = "";
  process.stdin.setEncoding("utf8");
  process.stdin.on("data", (chunk) => { text += chunk; });
  process.stdin.on("end", () => resolve(text));
}));
const { HttpAgent, buildResumeArray } = createRequire(plan.module)("@ag-ui/client");

const warnings = [];
console.warn = (...args) => { warnings.push(args.map(String).join(" ")); };
console.error = (...args) => { warnings.push(args.map(String).join(" ")); };

const agent = new HttpAgent({ url: plan.url, headers: plan.headers ?? {},
                              threadId: plan.threadId, initialMessages: plan.messages ?? [] });
const steps = [];
for (const step of plan.steps) {
  const events = [];
  const report = { runId: step.runId, events };
  agent.headers = { ...(plan.headers ?? {}), ...(step.headers ?? {}) };
  if (step.messages) agent.addMessages(step.messages);
  let resume = step.resume;
  if (resume && !Array.isArray(resume)) {
    const answer = resume.status === "cancelled" ? { status: "cancelled" }
      : { status: "resolved", payload: resume };
    resume = buildResumeArray(agent.pendingInterrupts,
      Object.fromEntries(agent.pendingInterrupts.map((i) => [i.id, answer])));
  }
  try {
    const out = await agent.runAgent(
      { runId: step.runId, tools: step.tools ?? [], forwardedProps: step.forwardedProps ?? {},
        ...(resume ? { resume } : {}) },
      { onEvent: ({ event }) => { events.push(event); } });
    report.result = out.result ?? null;
    report.newMessages = out.newMessages;
  } catch (error) {
    report.error = String(error?.message ?? error);
  }
  report.pendingInterrupts = agent.pendingInterrupts;
  steps.push(report);
}
process.stdout.write(JSON.stringify({ steps, warnings, messages: agent.messages }));
