/* Keep a runtime's listening sockets on one address: an LD_PRELOAD library for processes that bind to every
 * interface and have no option to bind to one (Ray's GCS server and raylet bind [::] or 0.0.0.0).
 *
 * With MESHGATE_BIND_HOST set (an IPv4 or IPv6 address), bind() to the wildcard address (0.0.0.0 or ::) binds to
 * that address instead, same port; an IPv4 host on an IPv6 socket becomes its v4-mapped form (::ffff:a.b.c.d).
 * Every other bind(), and every bind() without MESHGATE_BIND_HOST, passes through unchanged. If the host cannot
 * be used on that socket, bind() fails (EADDRNOTAVAIL): a runtime never falls back to listening everywhere.
 *
 * Built by backends/runner/bindshim.py: cc -shared -fPIC -O2 -o bindshim.so bindshim.c -ldl
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static bind_fn real_bind(void) {
    static bind_fn real;
    if (real == NULL) real = (bind_fn)dlsym(RTLD_NEXT, "bind");
    return real;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    const char *host = getenv("MESHGATE_BIND_HOST");
    struct in_addr v4;
    struct in6_addr v6;
    if (host == NULL || *host == '\0' || addr == NULL) return real_bind()(fd, addr, len);
    int is_v4 = inet_pton(AF_INET, host, &v4) == 1, is_v6 = !is_v4 && inet_pton(AF_INET6, host, &v6) == 1;
    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in in;
        memcpy(&in, addr, sizeof in);
        if (in.sin_addr.s_addr != htonl(INADDR_ANY)) return real_bind()(fd, addr, len);
        if (!is_v4) { errno = EADDRNOTAVAIL; return -1; }
        in.sin_addr = v4;
        return real_bind()(fd, (const struct sockaddr *)&in, sizeof in);
    }
    if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 in6;
        memcpy(&in6, addr, sizeof in6);
        if (!IN6_IS_ADDR_UNSPECIFIED(&in6.sin6_addr)) return real_bind()(fd, addr, len);
        if (is_v6) {
            in6.sin6_addr = v6;
        } else if (is_v4) {
            memset(&in6.sin6_addr, 0, sizeof in6.sin6_addr);
            in6.sin6_addr.s6_addr[10] = 0xff;
            in6.sin6_addr.s6_addr[11] = 0xff;
            memcpy(&in6.sin6_addr.s6_addr[12], &v4, 4);
        } else {
            errno = EADDRNOTAVAIL;
            return -1;
        }
        return real_bind()(fd, (const struct sockaddr *)&in6, sizeof in6);
    }
    return real_bind()(fd, addr, len);
}
