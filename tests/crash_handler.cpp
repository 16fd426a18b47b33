// Linked into every CUDA test binary: on SIGSEGV/SIGABRT/SIGBUS print the native stack (function names via
// -rdynamic) before dying, so a crash on the GPU machine leaves a readable trace in the log.
#include <execinfo.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <initializer_list>

namespace {

void on_crash(int sig) {
  const char* msg = "\n*** sonicmoe test crashed (signal ";
  (void)!write(STDERR_FILENO, msg, std::strlen(msg));
  char num[8];
  int n = 0, s = sig;
  do { num[n++] = static_cast<char>('0' + s % 10); s /= 10; } while (s && n < 7);
  while (n) (void)!write(STDERR_FILENO, &num[--n], 1);
  (void)!write(STDERR_FILENO, "); native stack:\n", 17);
  void* frames[64];
  const int depth = backtrace(frames, 64);
  backtrace_symbols_fd(frames, depth, STDERR_FILENO);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

const bool installed = [] {
  // An alternate stack, so that a stack overflow is reported too.
  static char alt[1 << 16];
  stack_t ss{};
  ss.ss_sp = alt;
  ss.ss_size = sizeof alt;
  sigaltstack(&ss, nullptr);
  struct sigaction sa {};
  sa.sa_handler = on_crash;
  sa.sa_flags = SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGSEGV, SIGBUS, SIGABRT}) sigaction(sig, &sa, nullptr);
  return true;
}();

}  // namespace
